"""Ranks the script starts itself with torch.multiprocessing.spawn (the shape of pytorch.org's DDP tutorial:
`mp.spawn(train, nprocs=N)`, each process calling init_process_group(rank=i, world_size=N) with a MASTER_PORT of
the script's own), launched as `dprorun python train.py`.

The launched process (dprorun's rank 0) trains nothing itself; each spawned process becomes a profiled rank once it
calls init_process_group: its session is installed there with the rank and world size the script gave (runtime/
bootstrap.install), so its DDP is profiled and its traces gathered as a torchrun rank's are. Before that call the
process sees the environment a plain `python train.py` gives it: the launcher's rank variables are taken away, and
where the script set a rendezvous address of its own its rank 0 serves the store there (the launcher's agent store
is only used where the script kept the launcher's MASTER_ADDR and MASTER_PORT).
"""
from __future__ import annotations

import functools
import inspect
import os
from dataclasses import dataclass
from typing import Any, Callable, Optional

LAUNCHER_RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                           "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME")
SPAWNED_MARK = "DPRO_SPAWNED_RANK"  # "1" in the environment of a rank the script spawned


@dataclass(frozen=True)
class SpawnedFrom:
    """What a spawned process needs from the process that spawned it (pickled with the script's function)."""
    parent_pid: int
    nprocs: int
    master_addr: Optional[str]  # the launcher's rendezvous address, as the launched process had it
    master_port: Optional[str]


def profiled_entry(fn: Callable, nprocs: int) -> Callable:
    """The function torch.multiprocessing.spawn runs in each process in place of the script's fn: picklable as the
    script's own is (a partial of two module-level functions)."""
    origin = SpawnedFrom(os.getpid(), int(nprocs), os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT"))
    return functools.partial(run_spawned_rank, fn, origin)


def run_spawned_rank(fn: Callable, origin: SpawnedFrom, index: int, *args: Any) -> Any:
    """In a spawned process: the environment a plain launch gives it, init_process_group watched, then the
    script's fn(index, *args)."""
    for name in LAUNCHER_RANK_VARIABLES:
        os.environ.pop(name, None)
    try:
        _watch_init_process_group(origin, index)
    except Exception as exc:  # never in the way of the script's own training
        from dprorun.runtime.log import warn

        warn(f"spawned process {index} is not profiled: {type(exc).__name__}: {exc}", index)
    return fn(index, *args)


def _watch_init_process_group(origin: SpawnedFrom, index: int) -> None:
    import torch.distributed as dist

    original = dist.init_process_group
    signature = inspect.signature(original)

    @functools.wraps(original)
    def becomes_a_rank(*args, **kwargs):
        dist.init_process_group = original  # once: the session installed below watches the call from here on
        rank, world_size = _rank_and_world(signature, args, kwargs, index, origin.nprocs)
        _rendezvous_as_a_plain_launch(origin, kwargs)
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


def _rendezvous_as_a_plain_launch(origin: SpawnedFrom, kwargs: dict) -> None:
    """The launcher's agent hosts the store its own ranks join (TORCHELASTIC_USE_AGENT_STORE=True); the spawned
    processes keep joining it only at the launcher's address, as they did before. A script that set an address of
    its own (the tutorial's MASTER_PORT 12355, or init_method="tcp://..."), waited there for a store nobody served:
    now its rank 0 serves it, as under a plain launch."""
    method = kwargs.get("init_method")
    own_address = (os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")) != \
        (origin.master_addr, origin.master_port)
    if own_address or (isinstance(method, str) and not method.startswith("env://")) or "store" in kwargs:
        os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)


def _install_rank_session(rank: int, index: int, world_size: int, nprocs: int) -> None:
    from dprorun.runtime import bootstrap

    os.environ["LOCAL_WORLD_SIZE"] = str(nprocs)  # the ranks sharing this host's cores (runtime/cpubudget.py)
    environ = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(index), WORLD_SIZE=str(world_size))
    environ.pop("DPRO_HOOKED_PID", None)
    environ[SPAWNED_MARK] = "1"
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
