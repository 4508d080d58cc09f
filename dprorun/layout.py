"""The run directory's layout: file and schema names, and the records of events.json, that the hooks write and the
readers read (one place)."""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from typing import Optional

MANIFEST_FILE = "manifest.json"
MANIFEST_SCHEMA = "dprorun-run"
EVENTS_FILE = "events.json"
EVENTS_SCHEMA = "dprorun-events"
CLEAN_FILE = "clean.json"
CLEAN_SCHEMA = "dprorun-clean"
KINETO_FILE = "kineto_trace.json"
SAMPLES_FILE = "samples.json"
ALIGNMENT_FILE = "alignment.json"
# a rank's warning, in events.json, for the exception its script raised (the hooks' excepthook; the launcher names it)
SCRIPT_RAISED = "training script raised "
STOPPED_BY_SIGTERM = "stopped by SIGTERM"  # a rank's records, where its launcher stopped it (a peer failed first)
# in the run directory, from rank 0 of ranks the script spawned itself (runtime/spawned.py): their world size
SPAWNED_FILE = "spawned.json"
SPAWNED_SCHEMA = "dprorun-spawned"
SUBPROCESS_SCRIPTS_FILE = "subprocess_scripts.txt"  # in a rank's folder: scripts it ran in child interpreters
# the hooks' warning where a script went on to train another model or set of parameters (runtime/session.py
# writes it, replay/ps_model.py repeats it in the PS model's notes)
PRIMARY_REPLACED = "the script went on to train another "


def rank_dir(run_dir: str, rank: int) -> str:
    """Where rank `rank`'s files lie in a run directory."""
    return os.path.join(run_dir, f"rank_{rank}")


def horovod_error_file(run_dir: str, rank: int) -> str:
    """Where a horovodrun rank whose script raised writes its error (torch elastic's format; torch elastic's agent
    gives each of its ranks a file of its own, horovodrun none): the launcher names the rank and the error with it,
    where the rank raised before it recorded anything (before hvd.init, say)."""
    return os.path.join(run_dir, "logs", f"horovod_rank_{rank}_error.json")


def rank_folders(run_dir: str) -> dict[int, str]:
    """Every rank_<r> folder of a run directory, by rank, in rank order (none where the directory is missing)."""
    try:
        names = os.listdir(run_dir)
    except OSError:
        return {}
    found = {int(name[5:]): os.path.join(run_dir, name) for name in names
             if name.startswith("rank_") and name[5:].isdigit()}
    return dict(sorted(found.items()))


# in the run directory: what an attempt of a job that torch elastic restarted (--max-restarts) left in the rank
# folders, set aside as the next attempt's ranks start (the run's own folders are then the last attempt's)
FAILED_ATTEMPT_DIR = "failed_attempt_{}"


def set_aside_a_failed_attempt(run_dir: str, attempt: int, rank: int, local_rank: int, local_world_size: int) -> str:
    """In a rank of torch elastic's restart `attempt` (TORCHELASTIC_RESTART_COUNT > 0), before it writes anything:
    the files the attempt before left in its folder moved to RUN/failed_attempt_<attempt - 1>/, so that no rank
    folder mixes two attempts (one whose window ended and one whose window did not). Rank 0 also moves the folders
    of ranks on other nodes (their files gathered to node 0 by that attempt). The manifest goes along as a copy
    (the folder is then a run directory of its own to `dpro summary`). Returns the folder the files went to, ""
    where there were none."""
    kept = os.path.join(run_dir, FAILED_ATTEMPT_DIR.format(attempt - 1))
    node_ranks = range(rank - local_rank, rank - local_rank + local_world_size)
    movers = {r: folder for r, folder in rank_folders(run_dir).items()
              if r == rank or (rank == 0 and r not in node_ranks)}
    for folder in movers.values():
        os.makedirs(kept, mode=0o700, exist_ok=True)
        target = os.path.join(kept, os.path.basename(folder))
        if os.path.exists(target):  # the same attempt's folder already set aside (a rank started twice): kept too
            target += f".{os.getpid()}"
        try:
            os.replace(folder, target)
        except FileNotFoundError:  # a run directory the nodes share: the folder's own rank moved it first
            pass
    manifest = os.path.join(run_dir, MANIFEST_FILE)
    if rank == 0 and movers and os.path.exists(manifest):
        shutil.copyfile(manifest, os.path.join(kept, MANIFEST_FILE))
    return kept if movers else ""


def ranks_with_records(run_dir: str) -> list[int]:
    """The ranks whose folder holds their records (events.json), in rank order: none where nothing was profiled."""
    return [rank for rank, folder in rank_folders(run_dir).items() if os.path.exists(os.path.join(folder, EVENTS_FILE))]


def holds_a_run(run_dir: str) -> bool:
    """A manifest or any rank's folder: what a launch (finished, failed or interrupted) leaves behind."""
    if not os.path.isdir(run_dir):
        return False
    return os.path.exists(os.path.join(run_dir, MANIFEST_FILE)) or bool(rank_folders(run_dir))


def claim_run_dir(run_dir: str, overwrite: bool = False) -> Optional[str]:
    """Before a launch: a run directory that already holds a run is refused (the message names it and the way
    out) and kept as it is; with `overwrite`, what that run left is removed first, so that two runs never mix in
    one directory. Returns the refusal, or None."""
    if not holds_a_run(run_dir):
        return None
    if not overwrite:
        described = ""
        try:
            with open(os.path.join(run_dir, MANIFEST_FILE)) as handle:
                manifest = json.load(handle)
            described = (f" (job {manifest.get('job_id')!r}, {manifest.get('status', 'status unknown')}, started "
                         f"{manifest.get('started_at', '?')})")
        except (OSError, ValueError, AttributeError):
            pass
        return (f"{run_dir} already holds a run{described}; it was left as it is. Choose another --run-dir, or "
                "pass --overwrite to replace it")
    for name in os.listdir(run_dir):
        path = os.path.join(run_dir, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)
    return None

# profiler annotation around a submodule's forward (runtime/scopes.py writes it, trace/rundir.py reads it)
SCOPE_PREFIX = "module:"

# TensorFlow workers: the profiler's XSpace (runtime/tf.py moves it here, trace/xplane.py reads it)
XPLANE_FILE = "xplane.pb"
# left in a worker's folder while TensorFlow's profiler stops: a worker that dies there leaves it (launch.py)
TF_PROFILER_STOP_MARK = "tf_profiler_stopping"
# --backend tf: every worker's host:port, in rank order (the launcher sets it; hooks/sitecustomize.py turns it
# into the worker's TF_CONFIG)
TF_WORKERS_ENV = "DPRO_TF_WORKERS"
TF_XLA_AUTO_JIT = "--tf_xla_auto_jit=2 --tf_xla_cpu_global_jit"  # Strategy.tf_xla: XLA auto-clustering, CPU ops too


# --backend mxnet: a worker's mx.profiler dump (runtime/mxnet.py writes it, trace/mxprofile.py reads it), and each
# parameter server's timed updates in server_<r>/server.json
MX_PROFILE_FILE = "mx_profile.json"
# an MXNet worker's place in the launch order (its log's [worker<i>]) where the kvstore numbered it otherwise, in the
# folder of the kvstore rank it got (runtime/mxnet.py writes it; launch_ps.py names a failed worker's traces by it)
MX_LAUNCH_INDEX_FILE = "launch_index"
SERVER_FILE = "server.json"
SERVER_SCHEMA = "dprorun-ps-server"
# keys of the end-of-window kvstore calibration's arrays (a model with this many parameters is unheard of)
PS_CALIBRATION_KEY_BASE = 900_000
NODE_CLOCKS_FILE = "node_clocks.json"  # a multi-host PS job: every node's clock against node 0's (node_link.py)
GATHERED_MARK = "GATHERED_FROM"  # in a role folder another node sent: that node's host name


def sparse_bucket_fields(grad, dense_nbytes: int) -> dict:
    """A bucket record's fields for one sparse gradient (DDP's gloo gathers it; horovod.torch all-gathers it): the
    bytes sent are its indices and values, the table's size beside them."""
    values, indices = grad._values(), grad._indices()
    return {"sparse": True, "dense_nbytes": dense_nbytes, "numel": values.numel(),
            "nbytes": values.numel() * values.element_size() + indices.numel() * indices.element_size()}


def server_dir(run_dir: str, server: int) -> str:
    """Where parameter server `server`'s files lie in a run directory."""
    return os.path.join(run_dir, f"server_{server}")


# ---- records of events.json ("comm", "p2p"): written by the hooks, read by trace/rundir.py ---------------------
# On disk each record is a JSON array in the field order below (compact: thousands per rank); in memory, on both
# sides, it is the dataclass, so no module unpacks a record by position.
@dataclass(slots=True)
class CommRecord:
    """One bucket's synchronisation as the hooks saw it: handed to the backend (enqueue -> enqueued: the hook's
    main-thread cost) and completed (done; None until the backend's callback ran)."""

    iteration: int
    ddp: int  # which DistributedDataParallel module (0: the first), or 0 for Horovod
    bucket: int
    enqueue_us: float
    enqueued_us: Optional[float] = None
    done_us: Optional[float] = None

    def row(self) -> list:
        return [self.iteration, self.ddp, self.bucket, self.enqueue_us, self.enqueued_us, self.done_us]

    @classmethod
    def from_row(cls, row: list) -> "CommRecord":
        iteration, ddp, bucket, enqueue, enqueued, done = row
        return cls(int(iteration), int(ddp), int(bucket), float(enqueue), float(enqueued), float(done))


@dataclass(slots=True)
class P2PRecord:
    """One measured ring step's SEND or RECV (`--comm-detail ring`)."""

    iteration: int
    ddp: int
    bucket: int
    step: int
    chunk: int
    src: int
    dst: int
    role: str  # "send" | "recv"
    start_us: float  # RECV: posted
    end_us: float
    nbytes: int

    def row(self) -> list:
        return [self.iteration, self.ddp, self.bucket, self.step, self.chunk, self.src, self.dst, self.role,
                self.start_us, self.end_us, self.nbytes]

    @classmethod
    def from_row(cls, row: list) -> "P2PRecord":
        iteration, ddp, bucket, step, chunk, src, dst, role, start, end, nbytes = row
        return cls(int(iteration), int(ddp), int(bucket), int(step), int(chunk), int(src), int(dst), str(role),
                   float(start), float(end), int(nbytes))


def node_offset_us(role_dir: str) -> float:
    """What to add to the times a role folder holds to put them on node 0's clock: the offset of the node it was
    gathered from (run_dir/node_clocks.json); 0 for node 0's own folders and single-host runs."""
    marker = os.path.join(role_dir, GATHERED_MARK)
    clocks = os.path.join(os.path.dirname(os.path.abspath(role_dir)), NODE_CLOCKS_FILE)
    if not os.path.exists(marker) or not os.path.exists(clocks):
        return 0.0
    try:
        with open(marker) as handle:
            host = handle.read().strip()
        with open(clocks) as handle:
            nodes = json.load(handle).get("nodes", {})
    except (OSError, ValueError):
        return 0.0
    return float(next((n.get("offset_us", 0.0) for n in nodes.values() if n.get("host") == host), 0.0))
