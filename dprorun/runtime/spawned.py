"""Ranks the script starts itself with torch.multiprocessing.spawn (the shape of pytorch.org's DDP tutorial:
`mp.spawn(train, nprocs=N)`, each process calling init_process_group(rank=i, world_size=N) with a MASTER_PORT of
the script's own), launched as `dprorun python train.py`.

The launched process (dprorun's rank 0) trains nothing itself; each spawned process is a rank: the launcher's rank
variables it inherited are made its own (RANK, LOCAL_RANK, WORLD_SIZE, ...: the index and the number spawned), the
store it rendezvous at is the launcher's agent's only where the script kept the launcher's MASTER_PORT (its rank 0
serves any other, as under a plain launch), and its session is installed at once as rank i of the N spawned
(runtime/bootstrap.install_in_spawned_rank), or as the rank and world size the script gives init_process_group where
they differ (ranks numbered across hosts), so its DDP is profiled and its traces gathered as a torchrun rank's are.
Its rank 0 writes the world size into the run directory with its records, for the launcher (finalize.py).
"""
from __future__ import annotations

import functools
import inspect
import os
from dataclasses import dataclass
from typing import Any, Callable, Optional

# the launcher's rank variables, which a spawned process inherits from the process launched: each spawned process
# gets its own in their place (a framework that read them in the launched process, as Lightning's ddp_spawn under a
# torchrun-like environment does, reads them again in each spawned one: before, every process was rank 0 of 1)
RANK_VARIABLES = ("RANK", "LOCAL_RANK", "ROLE_RANK")
WORLD_VARIABLES = ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "ROLE_WORLD_SIZE")


@dataclass(frozen=True)
class SpawnedFrom:
    """What a spawned process needs from the process that spawned it (pickled with the script's function)."""
    parent_pid: int
    nprocs: int
    launcher_port: Optional[str]  # the MASTER_PORT the launcher gave (its agent's store listens there)


def profiled_entry(fn: Callable, nprocs: int, launcher_port: Optional[str]) -> Callable:
    """The function torch.multiprocessing.spawn runs in each process in place of the script's fn: picklable as the
    script's own is (a partial of two module-level functions)."""
    return functools.partial(run_spawned_rank, fn, SpawnedFrom(os.getpid(), int(nprocs), launcher_port))


def run_spawned_rank(fn: Callable, origin: SpawnedFrom, index: int, *args: Any) -> Any:
    """In a spawned process: the environment a plain launch gives it, its session (rank `index` of the processes
    spawned, until init_process_group says otherwise), then the script's fn(index, *args)."""
    if "RANK" in os.environ:  # launched by dprorun (not the launcher's processes' own children)
        os.environ.update({name: str(index) for name in RANK_VARIABLES})
        os.environ.update({name: str(origin.nprocs) for name in WORLD_VARIABLES})
    try:
        _store_where_the_script_meets(origin.launcher_port)
        _install_rank_session(index, index, origin.nprocs, origin.nprocs)
        _watch_init_process_group(origin, index)
    except Exception as exc:  # never in the way of the script's own training
        from dprorun.runtime.log import warn

        warn(f"spawned process {index} is not profiled: {type(exc).__name__}: {exc}", index)
    return fn(index, *args)


def _store_where_the_script_meets(launcher_port: Optional[str]) -> None:
    """The launcher's agent hosts a store at its MASTER_PORT, which the launcher's ranks join as clients
    (TORCHELASTIC_USE_AGENT_STORE=True, inherited). The spawned ranks join it where the script kept that port; where
    it set an address of its own (the tutorial's MASTER_PORT 12355, init_method="tcp://...") their rank 0 serves the
    store there, as under a plain launch: before, they waited for a store nobody served until the timeout."""
    import importlib

    rendezvous = importlib.import_module("torch.distributed.rendezvous")  # the module (the package exports a function)
    create = rendezvous._create_c10d_store

    @functools.wraps(create)
    def created_where_the_script_meets(hostname, port, *args, **kwargs):
        if launcher_port is not None and str(port) == launcher_port:
            os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"
        else:
            os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
        return create(hostname, port, *args, **kwargs)

    rendezvous._create_c10d_store = created_where_the_script_meets


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
    if session is not None:
        session.spawned_by_script = True


def say_the_world_size(run_dir: str, world_size: int) -> None:
    """The launcher started fewer processes than the job has ranks: their rank 0 tells it how many with its records
    (layout.SPAWNED_FILE; a process spawned for other work writes none)."""
    from dprorun.fsutil import atomic_write_json
    from dprorun.layout import SPAWNED_FILE, SPAWNED_SCHEMA

    atomic_write_json(os.path.join(run_dir, SPAWNED_FILE), {"schema": SPAWNED_SCHEMA, "world_size": world_size})


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
