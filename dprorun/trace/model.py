"""The trace model: one set of dataclasses that every reader produces and every stage consumes.

Times are microseconds on the recording rank's wall clock (epoch µs), before alignment. Alignment adds a
per-rank offset (``RankTrace.clock_offset_us``) that puts the rank on rank 0's clock.

The same model carries PyTorch DDP (buckets over a ring all-reduce), Horovod (fused tensors, its own queueing
phases), parameter-server systems (PUSH/PULL between a worker and a server) and BytePS (partitioned tensors):
the framework-specific part is only in the readers.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields
from typing import Any, Iterable, Optional

TRACE_SCHEMA_VERSION = 1


class OpKind(str, enum.Enum):
    """What an op does, in dPRO's vocabulary."""

    FW = "FW"  # forward computation
    BW = "BW"  # backward computation
    COMM = "COMM"  # communication: transmission, or a stage of it (SEND/RECV/PUSH/PULL/allreduce)
    QUEUE = "QUEUE"  # communication waiting for its turn (enqueued, not yet transmitting)
    UPDATE = "UPDATE"  # optimizer step
    IO = "IO"  # data loading, host<->device copies outside communication
    VIRTUAL = "VIRTUAL"  # In/Out virtual ops of the global DFG, iteration markers
    OTHER = "OTHER"  # anything recorded that fits none of the above


@dataclass
class Op:
    """One recorded (or synthesised) operation."""

    name: str
    kind: OpKind
    rank: int
    start_us: float
    end_us: float
    iteration: int = -1  # -1: outside any iteration the hooks saw
    stream: str = "main"  # "main" (Python/compute thread), "comm", "cuda:0/s7", "gloo", ...
    host: str = ""
    device: str = "cpu"
    tensor: str = ""  # bucket or tensor key, e.g. "bucket3" or a Horovod tensor name
    nbytes: int = 0
    # communication detail (fine-grained ops); -1 / "" where not known
    peer: int = -1
    chunk: int = -1
    step: int = -1
    txn_id: str = ""
    phase: str = ""  # "queue", "transmit", "send", "recv", "memcpy_in", "negotiate", ...
    source: str = "hooks"  # which reader produced it: hooks, kineto, horovod, byteps, synth
    granularity: str = ""  # for COMM: "collective" when only the whole collective time is known
    args: dict = field(default_factory=dict)

    @property
    def dur_us(self) -> float:
        return self.end_us - self.start_us

    def to_dict(self) -> dict:
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "kind":
                value = value.value
            if value == f.default or (f.name == "args" and not value):
                continue
            out[f.name] = value
        out["name"] = self.name
        out["kind"] = self.kind.value
        out["rank"] = self.rank
        out["start_us"] = self.start_us
        out["end_us"] = self.end_us
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "Op":
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in known}
        kwargs["kind"] = OpKind(kwargs["kind"])
        kwargs["start_us"] = float(kwargs["start_us"])
        kwargs["end_us"] = float(kwargs["end_us"])
        return cls(**kwargs)


@dataclass
class Bucket:
    """A unit of gradient synchronisation: a DDP bucket, a Horovod fused response, a BytePS partition."""

    index: int
    nbytes: int
    params: list[str]
    dtype: str = "float32"
    numel: int = 0
    sparse: bool = False  # a sparse gradient (DDP: one embedding's): nbytes are its indices and values as sent
    buffer_nbytes: int = 0  # the gradients' own size where a comm hook sends fewer bytes (fp16 / bf16): 0 = nbytes
    # the script's comm hook works on the gradients beyond sending them (PowerSGD's factorisation: its bytes counted
    # by runtime/hook_bytes.py, no cast of torch's): its measured time is that work plus the transmission
    hook_work: bool = False
    ddp: int = 0  # which DistributedDataParallel module of the script's (0: the first; Horovod, TF, BytePS: 0)
    # the collective that sends it where it is no all-reduce: "reduce_scatter" (gradients summed, each rank keeping
    # its shard: nbytes the whole input) or "all_gather" (a sharded step's parameters gathered after the update:
    # nbytes the whole output); the script's own calls (runtime/collectives.py)
    collective: str = "all_reduce"
    # an all-gather between the backward and the step of gradients compressed by hand (each rank's top-k values or
    # indices: nbytes the gathered output, which grows with the ranks), not a sharded step's parameters
    gathers_gradients: bool = False
    # which all-reduce call of a TensorFlow step packed it: each optimizer's apply_gradients all-reduces its own
    # gradients in packs of its own (two optimizers: calls 0 and 1)
    pack_call: int = 0

    @property
    def key(self) -> str:
        """The name its synchronisation's ops carry (`Op.tensor`)."""
        return bucket_key(self.ddp, self.index)


def bucket_key(ddp: int, index: int) -> str:
    """A bucket's name in the ops and the replay: "bucket3" of the first DDP module, "ddp1.bucket0" of another."""
    return f"bucket{index}" if ddp == 0 else f"ddp{ddp}.bucket{index}"


@dataclass
class Sample:
    """One host or GPU sample (psutil / NVML)."""

    time_us: float
    source: str  # "host" or "gpu" (the GPU this rank uses; see meta["nvml_status"])
    values: dict[str, float]


@dataclass
class RankTrace:
    """Everything recorded on one rank."""

    rank: int
    host: str
    local_rank: int = 0
    ops: list[Op] = field(default_factory=list)
    buckets: list[Bucket] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    param_bytes: dict[str, int] = field(default_factory=dict)
    param_order: list[str] = field(default_factory=list)  # DDP's parameter order (model order)
    grad_ready: list[tuple[int, str, float]] = field(default_factory=list)  # (iteration, param, time)
    iterations: list[tuple[int, float, float]] = field(default_factory=list)  # (index, start, end)
    profiled_iterations: list[int] = field(default_factory=list)
    memory: dict[str, Any] = field(default_factory=dict)
    clock: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    clock_offset_us: float = 0.0
    # a GPU rank's profiler trace as read (its own clock, the reader's kinds: trace/kineto.KinetoTrace), for the
    # kernel-level DFG of its profiled steps (graph/kernels.py); None on CPU ranks and ranks read without detail
    kineto: Any = field(default=None, repr=False)

    def unprofiled_window_iterations(self) -> list[int]:
        """Window iterations that ran without torch.profiler (the job's speed under the cheap hooks)."""
        kineto = set(self.meta.get("kineto_iterations", []))
        rest = [i for i in self.profiled_iterations if i not in kineto]
        return rest or list(self.profiled_iterations)

    def iteration_times_us(self, only_profiled: bool = True) -> list[float]:
        chosen = set(self.profiled_iterations) if only_profiled and self.profiled_iterations else None
        return [end - start for idx, start, end in self.iterations if chosen is None or idx in chosen]


@dataclass
class RunTrace:
    """A whole job: every rank plus the manifest."""

    run_dir: str
    manifest: dict[str, Any]
    ranks: dict[int, RankTrace]
    missing_ranks: list[int] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    horovod_timeline: Optional[Any] = None  # trace.horovod.HorovodTimeline of a Horovod job, where recorded

    @property
    def world_size(self) -> int:
        return int(self.manifest.get("world_size", len(self.ranks)))

    def all_ops(self) -> Iterable[Op]:
        for rank in sorted(self.ranks):
            yield from self.ranks[rank].ops


def ddp_groups(run: RunTrace) -> list[list[int]]:
    """The process groups the ranks' DDP modules all-reduce in, where smaller than the job's world (a script that
    trains a replica per subgroup); [] where every rank's DDP spans the world or the groups were not recorded."""
    groups = set()
    for rank, trace in run.ranks.items():
        ranks = next((t.get("group_ranks") for t in trace.meta.get("trackers", []) if "ddp" in t), None)
        if not isinstance(ranks, list) or not ranks:
            continue
        if rank not in ranks:  # a record that is not this rank's own (a run directory put together by hand)
            return []
        groups.add(tuple(sorted(int(r) for r in ranks)))
    if not groups or all(len(g) >= run.world_size for g in groups):
        return []
    return [list(g) for g in sorted(groups)]


def is_tf_tracker(tracker: dict) -> bool:
    """A worker's tracker description from TensorFlow hooks (MultiWorkerMirroredStrategy, or horovod.tensorflow:
    framework "horovod" with "tf")."""
    return tracker.get("framework") == "tf" or bool(tracker.get("tf"))
