"""Ranks the script starts itself from the one process dprorun launched (`dprorun python train.py`):
torch.multiprocessing.spawn (pytorch.org's DDP tutorial: `mp.spawn(train, nprocs=N)`, each process calling
init_process_group(rank=i, world_size=N) with a MASTER_PORT of its own; Lightning's ddp_spawn, Ignite's Parallel),
or multiprocessing.Process (pytorch.org's "Writing Distributed Applications": `mp.Process(target=init_process,
args=(rank, size, run))`), under any start method, or a launcher of the script's own running each rank as a
subprocess (`python train.py` with RANK, WORLD_SIZE and MASTER_PORT in its environment).

The launched process trains nothing itself; each process it starts that trains is a rank: the launcher's rank
variables it inherited are made its own (RANK, LOCAL_RANK, WORLD_SIZE, ...), the store it rendezvous at is the
launcher's agent's only where the script kept the launcher's MASTER_PORT (its rank 0 serves any other, as under a
plain launch: before, the ranks waited for a store nobody served until the timeout), and its session is installed
(runtime/bootstrap.become_rank) as rank i of the N spawned from the start (mp.spawn gives the index), and
as the rank and world size the script gives init_process_group where those are others or unknown before (a
multiprocessing.Process), so its DDP is profiled and its traces gathered as a torchrun rank's are. Its rank 0 writes
the world size into the run directory with its records, for the launcher (finalize.py). The session side lives
in runtime/bootstrap.py, which hands `become_rank` to the watches here.

How each process is reached: mp.spawn's function is replaced by a picklable stand-in (bootstrap.profiled_entry); a child
interpreter of the launch (start methods spawn and forkserver, a subprocess) watches torch.distributed when imported
(`child_patches`, from bootstrap.install); a forked child watches it at the fork (`watch_after_fork`).
"""
from __future__ import annotations

import functools
import inspect
import os
from typing import Callable, Optional

# in the one process dprorun launched (a DDP job of one rank) and every process it starts: "<port>,<run id>", the
# port of the launcher's agent store and the launch's torch elastic run id
ONE_PROCESS_LAUNCH = "DPRO_ONE_PROCESS_LAUNCH"
WATCHED = "_dprorun_spawned_watch"  # marks the functions wrapped here (each wrapped once a process)
Become = Callable[[int, int], None]  # makes this process rank r of a world of w (runtime/bootstrap.become_rank)


def mark_a_one_process_launch(world_size: int, backend: Optional[str], become: Become) -> None:
    """In the process dprorun launched: a DDP job of one process may start its ranks itself."""
    if world_size == 1 and backend in (None, "", "ddp"):
        launch = (os.environ.get("MASTER_PORT", ""), os.environ.get("TORCHELASTIC_RUN_ID", ""))
        os.environ[ONE_PROCESS_LAUNCH] = ",".join(launch)
        os.register_at_fork(after_in_child=functools.partial(watch_after_fork, become))


def child_patches(become: Become) -> dict[str, Callable[[], None]]:
    """A child interpreter of a one-process launch (multiprocessing's spawn or forkserver, or a subprocess): module ->
    the watch applied once it is imported."""
    return {"torch.distributed": functools.partial(watch_torch_distributed, become),
            **{name: functools.partial(lightning_starts_its_ranks, name, None) for name in LIGHTNING_ENVIRONMENTS}}


# Lightning's cluster environments: `dprorun python train.py` of a Trainer (or Fabric) on N devices with strategy
# "ddp" (its default launch: the main process trains as rank 0 and starts the script N - 1 times more, each with its
# LOCAL_RANK) runs as under `python train.py`. The launch's torch elastic variables (TORCHELASTIC_RUN_ID, LOCAL_RANK)
# made Lightning take it for torchrun's, which starts every process, and refuse its world of one ("You set
# `devices=2` ... does not match the world size (1)").
LIGHTNING_ENVIRONMENTS = ("lightning.fabric.plugins.environments", "lightning_fabric.plugins.environments")


def lightning_starts_its_ranks(module_name: str, become: Optional[Become]) -> None:
    """In a one-process launch: torch elastic's environment not detected by Lightning (its own taken, as under
    `python train.py`). In the launched process (`become` given) Lightning's environment says the processes are not
    created externally until Lightning has set the job's WORLD_SIZE (the launch's is 1; Lightning sets it as it
    starts the other ranks), and the process becomes rank 0 of Lightning's world at init_process_group. The launch's
    LOCAL_RANK stays (a script that only imports Lightning reads it as under torchrun). The processes Lightning starts
    are ranks as any subprocess of the launch (watch_torch_distributed)."""
    import sys

    if ONE_PROCESS_LAUNCH not in os.environ:
        return
    module = sys.modules.get(module_name)
    torchelastic = getattr(module, "TorchElasticEnvironment", None)
    if torchelastic is None or getattr(torchelastic.detect, WATCHED, False):
        return

    def detect() -> bool:
        return False

    setattr(detect, WATCHED, True)
    torchelastic.detect = staticmethod(detect)
    lightning = getattr(module, "LightningEnvironment", None)
    if become is None or not isinstance(getattr(lightning, "creates_processes_externally", None), property):
        return
    externally = lightning.creates_processes_externally.fget

    def not_before_lightning_starts_them(self) -> bool:
        if os.environ.get("WORLD_SIZE", "1") == "1":
            watch_torch_distributed(become)
            return False
        return externally(self)

    lightning.creates_processes_externally = property(not_before_lightning_starts_them)


def watch_after_fork(become: Become) -> None:
    """A process forked from the launched one (or from a process it started): torch.distributed watched, if loaded
    (a data loader's worker never calls init_process_group: nothing changes for it)."""
    import sys

    if ONE_PROCESS_LAUNCH in os.environ and "torch.distributed" in sys.modules:
        try:
            watch_torch_distributed(become)
        except Exception:
            pass


def watch_torch_distributed(become: Become) -> None:
    import importlib

    _store_where_the_script_meets(importlib.import_module("torch.distributed.rendezvous"))
    _watch_init_process_group(importlib.import_module("torch.distributed"), become)


def _store_where_the_script_meets(rendezvous) -> None:
    """The launcher's agent hosts a store at its MASTER_PORT, which the launcher's ranks join as clients
    (TORCHELASTIC_USE_AGENT_STORE=True, inherited). The script's ranks join it where the script kept that port; where
    it set an address of its own (the tutorial's MASTER_PORT 12355, init_method="tcp://...") their rank 0 serves the
    store there, as under a plain launch."""
    create = rendezvous._create_c10d_store
    if getattr(create, WATCHED, False):
        return
    launcher_port, _ = launch_of_this_job()

    @functools.wraps(create)
    def created_where_the_script_meets(hostname, port, *args, **kwargs):
        if started_by_another_agent():
            pass  # an elastic agent the script ran (torch.distributed.launcher.api): its own store, its own word
        elif launcher_port and str(port) == launcher_port:
            os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"
        else:
            os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
        return create(hostname, port, *args, **kwargs)

    setattr(created_where_the_script_meets, WATCHED, True)
    rendezvous._create_c10d_store = created_where_the_script_meets


def launch_of_this_job() -> tuple[str, str]:
    """(the launcher's MASTER_PORT, its torch elastic run id), as the launched process marked them."""
    port, _, run_id = os.environ.get(ONE_PROCESS_LAUNCH, "").partition(",")
    return port, run_id


def started_by_another_agent() -> bool:
    """A worker of a torch elastic agent the script runs itself (torch.distributed.launcher.api.elastic_launch): its
    rank variables and store are that agent's (another run id than dprorun's launch)."""
    _, run_id = launch_of_this_job()
    return bool(run_id) and os.environ.get("TORCHELASTIC_RUN_ID", run_id) != run_id


def _watch_init_process_group(dist, become: Become) -> None:
    """At init_process_group the process becomes the rank the script gives (or, not given, the one it was given at
    the spawn, else RANK and WORLD_SIZE as the script set them), nothing having been recorded yet. A script that
    imported the function itself (`from torch.distributed import init_process_group`) is seen where mp.spawn started
    it (the index's rank), not where it started a multiprocessing.Process."""
    original = dist.init_process_group
    if getattr(original, WATCHED, False):
        return
    signature = inspect.signature(original)

    redirected = [False]  # the call passed on to the session's own watch, which comes back here

    @functools.wraps(original)
    def becomes_a_rank(*args, **kwargs):
        rank, world_size = _rank_and_world(signature, args, kwargs)
        if rank is not None and world_size is not None and not redirected[0]:
            become(rank, world_size)  # the agent's rank variables kept where another agent started this worker
            if dist.init_process_group is not becomes_a_rank:  # a new session's watch wraps this one: through it
                redirected[0] = True
                try:
                    return dist.init_process_group(*args, **kwargs)
                finally:
                    redirected[0] = False
        return original(*args, **kwargs)

    setattr(becomes_a_rank, WATCHED, True)
    dist.init_process_group = becomes_a_rank


def _rank_and_world(signature: inspect.Signature, args: tuple, kwargs: dict) -> tuple[Optional[int], Optional[int]]:
    """The rank and world size the script gives init_process_group (arguments first, then RANK and WORLD_SIZE as
    the process has them: the spawn's, or the script's own)."""
    try:
        bound = signature.bind_partial(*args, **kwargs).arguments
    except TypeError:
        bound = {}
    rank, world_size = bound.get("rank"), bound.get("world_size")
    rank = int(rank) if rank is not None and int(rank) >= 0 else _int_or_none(os.environ.get("RANK"))
    world_size = int(world_size) if world_size is not None and int(world_size) > 0 else \
        _int_or_none(os.environ.get("WORLD_SIZE"))
    return rank, world_size


def _int_or_none(text: Optional[str]) -> Optional[int]:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


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
