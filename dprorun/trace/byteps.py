"""Reader for BytePS communication traces (`comm.json`, written by a worker process with BYTEPS_TRACE_ON=1 to
$BYTEPS_TRACE_DIR/<local rank>/comm.json), stock BytePS.

The file is a Chrome-trace object {"traceEvents": [...]} of complete ("X") events, times in epoch µs. Each
tensor is a "process" (`pid` = "Comm.<tensor name>"); per tensor and step there is one event with tid "total"
(the tensor's whole synchronisation in that step) and, per partition (tid = partition index; BytePS splits a
tensor into BYTEPS_PARTITION_BYTES pieces), one event per stage it passed through, named "<pid>.<STAGE>":
  COORDINATE_REDUCE / COORDINATE_PUSH / COORDINATE_BROADCAST   the local GPUs agreeing the partition is ready
  REDUCE          intra-host reduce onto the root GPU (NCCL)
  COPYD2H         the reduced partition to host memory
  PUSH / PULL     to and from the server owning the partition (network; only the root GPU's file has them)
  COPYH2D         the aggregated partition back to the GPU
  BROADCAST       intra-host broadcast from the root GPU (NCCL)
A stage's span is from its entry into the stage's queue to its completion, so it holds queueing behind the
partitions ahead of it as well as the work itself (60 REDUCE spans all start within 3 ms and end one after
another); `stage_service_times` separates the two.

Mapped into the trace model (one RankTrace per file, times on the file's epoch clock):
  COORDINATE_*   QUEUE  phase "coordinate_reduce" / "coordinate_push" / "coordinate_broadcast"
  other stages   COMM   phase = the stage in lower case ("reduce", "copyd2h", "push", ...)
every op with `tensor`, `chunk` = partition, `iteration` = the step whose "total" span holds it, `stream`
"byteps.<stage>", `source` "byteps". The steps' spans become the RankTrace's iterations (the synchronisation
of every tensor in that step); one Bucket per (tensor, partition), bytes unknown (the file has no sizes).
A file cut short (a job killed mid-write) is read up to its last complete event and `truncated` says so.
"""
from __future__ import annotations

import bisect
import gzip
import json
import math
from dataclasses import dataclass, field

from dprorun.fsutil import TraceError, complete_json_objects
from dprorun.trace.model import Bucket, Op, OpKind, RankTrace

# the order a partition passes through BytePS's stages (a root GPU's file; a non-root one skips PUSH/PULL)
STAGE_ORDER = ("COORDINATE_REDUCE", "REDUCE", "COPYD2H", "COORDINATE_PUSH", "PUSH", "PULL", "COPYH2D",
               "COORDINATE_BROADCAST", "BROADCAST")
NETWORK_STAGES = ("PUSH", "PULL")


@dataclass
class BytePSTrace:
    path: str
    trace: RankTrace
    tensors: list[str]
    partitions: dict[str, int]  # tensor -> number of partitions
    stages: list[str]  # the stages present, in BytePS's order
    steps: int
    sync_spans: dict[tuple[str, int], tuple[float, float]] = field(default_factory=dict)  # (tensor, step)
    truncated: bool = False

    @property
    def role(self) -> str:
        """"root": this GPU pushed and pulled (the file has PUSH/PULL); "worker": a non-root GPU of its host."""
        return "root" if any(s in self.stages for s in NETWORK_STAGES) else "worker"


def _read_text(path: str) -> str:
    try:
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8", errors="replace") as handle:
            return handle.read()
    except (OSError, EOFError) as exc:  # EOFError: a .gz cut short
        raise TraceError(path, f"cannot be read ({getattr(exc, 'strerror', None) or exc})") from None


def _load_events(path: str) -> tuple[list[dict], bool]:
    text = _read_text(path).strip()
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        doc = None
    if isinstance(doc, dict):
        events = doc.get("traceEvents")
        if not isinstance(events, list):
            raise TraceError(path, "not a BytePS comm.json (no traceEvents list)")
        return [e for e in events if isinstance(e, dict)], False
    if doc is not None:
        raise TraceError(path, "not a BytePS comm.json (expected a JSON object with traceEvents)")
    key = text.find('"traceEvents"')
    start = text.find("[", key) if key >= 0 else -1
    if start < 0:
        raise TraceError(path, "not a BytePS comm.json (no traceEvents list)")
    events = complete_json_objects(text, start + 1)  # cut short: every complete event
    if not events:
        raise TraceError(path, "truncated or corrupted BytePS comm.json: no complete event")
    return events, True


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _stage_of(event: dict) -> tuple[str, str]:
    """(tensor, stage) of an event; stage "" for the tensor's "total" span."""
    pid, name = str(event.get("pid", "")), str(event.get("name", ""))
    tensor = pid[len("Comm."):] if pid.startswith("Comm.") else pid
    if str(event.get("tid")) == "total" or name == pid:
        return tensor, ""
    if pid and name.startswith(pid + "."):
        return tensor, name[len(pid) + 1:]
    head, _, stage = name.rpartition(".")
    return (head[len("Comm."):] if head.startswith("Comm.") else head), stage


def read_byteps_comm(path: str, rank: int = 0, host: str = "") -> BytePSTrace:
    events, truncated = _load_events(path)
    totals: dict[str, list[tuple[float, float]]] = {}
    staged: list[tuple[str, str, int, float, float]] = []
    for e in events:
        ts, dur = e.get("ts"), e.get("dur", 0.0)
        if e.get("ph") != "X" or not _is_number(ts) or not _is_number(dur):
            continue  # not a complete event with numeric times (metadata, or a damaged record)
        tensor, stage = _stage_of(e)
        start = float(ts)
        end = start + max(0.0, float(dur))
        if not stage:
            totals.setdefault(tensor, []).append((start, end))
            continue
        try:
            partition = int(e.get("tid"))
        except (TypeError, ValueError):
            partition = -1
        staged.append((tensor, stage.upper(), partition, start, end))
    if not staged:
        raise TraceError(path, "no BytePS stage event (expected events named Comm.<tensor>.<STAGE>)")
    spans: dict[tuple[str, int], tuple[float, float]] = {}
    for tensor, spans_of in totals.items():
        for step, span in enumerate(sorted(spans_of)):
            spans[(tensor, step)] = span
    by_tensor = {t: sorted(v) for t, v in totals.items()}
    starts = {t: [a for a, _ in v] for t, v in by_tensor.items()}
    ops: list[Op] = []
    for tensor, stage, partition, start, end in staged:
        k = bisect.bisect_right(starts.get(tensor, []), start + 1.0) - 1  # 1 µs: the file's rounding
        step = k if k >= 0 and start <= by_tensor[tensor][k][1] + 1.0 else -1
        kind = OpKind.QUEUE if stage.startswith("COORDINATE") else OpKind.COMM
        ops.append(Op(name=f"{stage}.{tensor}.p{partition}", kind=kind, rank=rank, start_us=start, end_us=end,
                      iteration=step, stream=f"byteps.{stage.lower()}", host=host, tensor=tensor,
                      chunk=partition, phase=stage.lower(), source="byteps"))
    ops.sort(key=lambda o: (o.start_us, o.end_us))
    tensors = sorted({t for t, *_ in staged})
    partitions = {t: len({p for tt, _, p, _, _ in staged if tt == t}) for t in tensors}
    present = {s for _, s, *_ in staged}
    stages = [s for s in STAGE_ORDER if s in present] + sorted(present - set(STAGE_ORDER))
    steps = max((s + 1 for _, s in spans), default=0)
    trace = RankTrace(rank=rank, host=host, ops=ops)
    for step in range(steps):
        step_spans = [span for (t, s), span in spans.items() if s == step]
        trace.iterations.append((step, min(a for a, _ in step_spans), max(b for _, b in step_spans)))
    trace.profiled_iterations = list(range(steps))
    trace.buckets = [Bucket(index=k, nbytes=0, params=[f"{t}.p{p}"])
                     for k, (t, p) in enumerate((t, p) for t in tensors for p in range(partitions[t]))]
    trace.meta.update({"source": "byteps comm.json", "framework": "byteps", "path": path, "truncated": truncated})
    return BytePSTrace(path, trace, tensors, partitions, stages, steps, spans, truncated)
