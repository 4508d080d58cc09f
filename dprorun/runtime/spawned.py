"""Ranks the script starts itself with torch.multiprocessing.spawn (the shape of pytorch.org's DDP tutorial:
`mp.spawn(train, nprocs=N)`, each process calling init_process_group(rank=i, world_size=N) with a MASTER_PORT of
the script's own), launched as `dprorun python train.py`.

The launched process (dprorun's rank 0) trains nothing itself; each spawned process is a rank: it sees the
environment a plain `python train.py` gives it (the launcher's rank variables taken away, and its agent's store:
the rendezvous the script sets, or keeps, is served by its rank 0; where the script kept the launcher's MASTER_PORT,
a free one stands in for it, the agent listening there), and its session is installed at once as rank i of the N
spawned (runtime/bootstrap.install_in_spawned_rank), or as the rank and world size the script gives
init_process_group where they differ (ranks numbered across hosts), so its DDP is profiled and its traces gathered as
a torchrun rank's are. Its rank 0 writes the world size into the run directory for the launcher (finalize.py).
"""
from __future__ import annotations

import functools
import inspect
import os
from dataclasses import dataclass
from typing import Any, Callable, Optional

# what the launcher gave the process it started, and a plain `python train.py` does not: its rank, and the store its
# agent hosts, which the launcher's ranks join as clients
LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                      "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "TORCHELASTIC_USE_AGENT_STORE")


@dataclass(frozen=True)
class SpawnedFrom:
    """What a spawned process needs from the process that spawned it (pickled with the script's function)."""
    parent_pid: int
    nprocs: int
    launcher_port: Optional[str]  # the MASTER_PORT the launcher gave (its agent's store listens there)
    own_port: Optional[str]  # where the spawned ranks' store goes in its place (None: the script set its own)


def profiled_entry(fn: Callable, nprocs: int, launcher_port: Optional[str]) -> Callable:
    """The function torch.multiprocessing.spawn runs in each process in place of the script's fn: picklable as the
    script's own is (a partial of two module-level functions)."""
    from dprorun.procs import free_port

    kept = launcher_port is not None and os.environ.get("MASTER_PORT") == launcher_port
    origin = SpawnedFrom(os.getpid(), int(nprocs), launcher_port, str(free_port()) if kept else None)
    return functools.partial(run_spawned_rank, fn, origin)


def run_spawned_rank(fn: Callable, origin: SpawnedFrom, index: int, *args: Any) -> Any:
    """In a spawned process: the environment a plain launch gives it, its session (rank `index` of the processes
    spawned, until init_process_group says otherwise), then the script's fn(index, *args)."""
    for name in LAUNCHER_VARIABLES:
        os.environ.pop(name, None)
    if origin.own_port is not None and os.environ.get("MASTER_PORT") == origin.launcher_port:
        os.environ["MASTER_PORT"] = origin.own_port  # the launcher's port is its agent's: the ranks' rank 0 serves
    try:
        _install_rank_session(index, index, origin.nprocs, origin.nprocs)
        _watch_init_process_group(origin, index)
    except Exception as exc:  # never in the way of the script's own training
        from dprorun.runtime.log import warn

        warn(f"spawned process {index} is not profiled: {type(exc).__name__}: {exc}", index)
    return fn(index, *args)


def _watch_init_process_group(origin: SpawnedFrom, index: int) -> None:
    """A rank or world size the script gives init_process_group other than the process's index and the number
    spawned (ranks numbered across hosts): the session takes them, nothing having been recorded yet. A script that
    imported the function itself (`from torch.distributed import init_process_group`) keeps the index's."""
    import torch.distributed as dist

    original = dist.init_process_group
    signature = inspect.signature(original)

    @functools.wraps(original)
    def becomes_a_rank(*args, **kwargs):
        dist.init_process_group = original  # once: the session's own watcher sees the call from here on
        rank, world_size = _rank_and_world(signature, args, kwargs, index, origin.nprocs)
        if (rank, world_size) != (index, origin.nprocs):
            _install_rank_session(rank, index, world_size, origin.nprocs)
        return dist.init_process_group(*args, **kwargs)

    dist.init_process_group = becomes_a_rank


def _rank_and_world(signature: inspect.Signature, args: tuple, kwargs: dict, index: int,
                    nprocs: int) -> tuple[int, int]:
    """The rank and world size the script gives init_process_group (arguments first, then RANK and WORLD_SIZE if the
    script set them itself), else the process's index and the number spawned."""
    try:
        bound = signature.bind_partial(*args, **kwargs).arguments
    except TypeError:
        bound = {}
    rank = bound.get("rank", -1)
    world_size = bound.get("world_size", -1)
    if rank is None or int(rank) < 0:
        rank = int(os.environ.get("RANK", index))
    if world_size is None or int(world_size) < 0:
        world_size = int(os.environ.get("WORLD_SIZE", nprocs))
    return int(rank), int(world_size)


def _install_rank_session(rank: int, index: int, world_size: int, nprocs: int) -> None:
    from dprorun.runtime import bootstrap

    environ = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(index), WORLD_SIZE=str(world_size),
                   LOCAL_WORLD_SIZE=str(nprocs))
    environ.pop("DPRO_HOOKED_PID", None)
    session = bootstrap.install_in_spawned_rank(environ)
    if session is not None and rank == 0:
        _say_the_world_size(session.cfg.run_dir, world_size, nprocs)


def _say_the_world_size(run_dir: str, world_size: int, nprocs: int) -> None:
    """The launcher started fewer processes than the job has ranks: rank 0 tells it how many (layout.SPAWNED_FILE)."""
    from dprorun.fsutil import atomic_write_json
    from dprorun.layout import SPAWNED_FILE, SPAWNED_SCHEMA

    atomic_write_json(os.path.join(run_dir, SPAWNED_FILE),
                      {"schema": SPAWNED_SCHEMA, "world_size": world_size, "spawned_here": nprocs})


def read_spawned_world_size(run_dir: str) -> Optional[int]:
    """The world size of ranks a script spawned itself, as their rank 0 wrote it; None for any other job."""
    import json

    from dprorun.layout import SPAWNED_FILE, SPAWNED_SCHEMA

    try:
        with open(os.path.join(run_dir, SPAWNED_FILE)) as handle:
            doc = json.load(handle)
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("schema") != SPAWNED_SCHEMA:
        return None
    try:
        return int(doc["world_size"]) if int(doc["world_size"]) > 0 else None
    except (KeyError, TypeError, ValueError):
        return None
