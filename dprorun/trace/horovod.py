"""Reader for Horovod timeline files (HOROVOD_TIMELINE / horovodrun --timeline-filename), stock Horovod.

The timeline is a Chrome-trace JSON array written by the coordinator (rank 0): one "process" per tensor
(`process_name` = "allreduce.<name>", "broadcast.<name>", ...; pid 0's metadata holds
`start_time_since_epoch_in_micros`), and per tensor and step: `NEGOTIATE_<OP>` (B/E; "X" marks named by rank
number when each rank reported the tensor ready), then the operation `<OP>` (B/E; the E event carries dtype and
shape) around its activities: `WAIT_FOR_DATA`, `QUEUE`, `INIT_FUSION_BUFFER`, `MEMCPY_IN_FUSION_BUFFER`,
`<LIB>_<OP>` (GLOO_ALLREDUCE, NCCL_ALLREDUCE, MPI_ALLREDUCE, ...), `MEMCPY_OUT_FUSION_BUFFER`.
A file cut short (a job killed mid-write) lacks the closing bracket or ends mid-object: the complete events
are read and `truncated` says so.

Mapped into the trace model (one RankTrace, the coordinator's view; times on its epoch clock):
  NEGOTIATE_*                  QUEUE  phase "negotiate"   (first rank ready -> all ranks ready)
  WAIT_FOR_DATA, QUEUE         QUEUE  phase "wait_for_data" / "queue"
  MEMCPY_IN/OUT_FUSION_BUFFER  COMM   phase "memcpy_in" / "memcpy_out"
  INIT_FUSION_BUFFER           COMM   phase "init_fusion_buffer"
  <LIB>_<OP>                   COMM   phase "transmit", granularity "collective"
Each tensor's n-th operation is its step n (`iteration`); broadcasts, which set the initial parameters, dprorun's
calibration and horovod.tensorflow's eager calls get -1 (`is_step_tensor`). Tensors whose transmission starts and ends
together
were fused into one response: they share `txn_id` "fused<k>" and appear as one Bucket per response of the
first complete step.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Optional

from dprorun.fsutil import TraceError, complete_json_objects
from dprorun.trace.model import Bucket, Op, OpKind, RankTrace

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int32": 4, "int64": 8, "uint8": 1,
               "int8": 1, "bool": 1}
QUEUE_PHASES = {"WAIT_FOR_DATA": "wait_for_data", "QUEUE": "queue"}
COPY_PHASES = {"MEMCPY_IN_FUSION_BUFFER": "memcpy_in", "MEMCPY_OUT_FUSION_BUFFER": "memcpy_out",
               "INIT_FUSION_BUFFER": "init_fusion_buffer"}
LIB_OP = re.compile(r"^(GLOO|NCCL|MPI|CCL|DDL|ADASUM|ROCM)_([A-Z_]+)$")
FUSED_TOLERANCE_US = 50.0


@dataclass
class HorovodTimeline:
    path: str
    trace: RankTrace
    tensors: list[str]
    steps: int
    fused_responses: list[list[str]]  # per response of the first complete step: its tensors
    ready_marks: dict[tuple[str, int], dict[int, float]] = field(default_factory=dict)  # (tensor, step) -> rank: t
    truncated: bool = False


def _load_events(path: str) -> tuple[list[dict], bool]:
    try:
        with open(path, "r", encoding="utf-8", errors="replace") as handle:
            text = handle.read()
    except OSError as exc:
        raise TraceError(path, f"cannot be read ({exc.strerror})") from None
    stripped = text.strip()
    if not stripped.startswith("["):
        raise TraceError(path, "not a Horovod timeline (expected a JSON array of trace events)")
    try:
        events = json.loads(stripped)
        if not isinstance(events, list):
            raise TraceError(path, "not a Horovod timeline (expected a JSON array)")
        return events, False
    except json.JSONDecodeError:
        pass
    events = complete_json_objects(stripped, 1)  # cut short: take every complete object
    if not events:
        raise TraceError(path, "truncated or corrupted Horovod timeline: no complete event")
    return events, True


def _nbytes(args: dict) -> int:
    shape = args.get("shape", "")
    dims = [int(x) for x in re.findall(r"\d+", shape)] if isinstance(shape, str) else []
    count = 1
    for d in dims:
        count *= d
    return count * DTYPE_BYTES.get(str(args.get("dtype", "float32")), 4) if dims or shape == "[]" else 0


def read_horovod_timeline(path: str, rank: int = 0, host: str = "") -> HorovodTimeline:
    events, truncated = _load_events(path)
    base = 0.0
    names: dict[int, str] = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            args = e.get("args") or {}
            if "start_time_since_epoch_in_micros" in args:
                base = float(args["start_time_since_epoch_in_micros"])
            elif "name" in args:
                names[e.get("pid")] = str(args["name"])
    if not names:
        raise TraceError(path, "no tensor in this Horovod timeline (no process_name metadata)")
    stacks: dict[int, list[tuple[str, float]]] = {}
    step_of: dict[int, int] = {}
    ops: list[Op] = []
    ready: dict[tuple[str, int], dict[int, float]] = {}
    repaired = 0
    for e in events:
        ph, pid = e.get("ph"), e.get("pid")
        if ph not in ("B", "E", "X") or pid not in names:
            continue
        tensor_full = names[pid]
        kind_name, _, tensor = tensor_full.partition(".")
        ts = base + float(e.get("ts", 0.0))
        stack = stacks.setdefault(pid, [])
        step = step_of.get(pid, 0)
        common = dict(rank=rank, iteration=step if is_step_tensor(tensor_full) else -1, stream="comm", host=host,
                      tensor=tensor or tensor_full, source="horovod")
        if ph == "X":
            if str(e.get("name", "")).isdigit() and stack and stack[-1][0].startswith("NEGOTIATE"):
                ready.setdefault((common["tensor"], step), {})[int(e["name"])] = ts
        elif ph == "B":
            name = str(e.get("name", ""))
            if stack and stack[-1][0].startswith("NEGOTIATE") and not name.startswith("NEGOTIATE"):
                # the operation starts while its negotiation is open: Horovod wrote no E for it (a cached response's
                # negotiation can open without closing); it ended when the operation began
                ops += _phase_op(*stack.pop(), ts, common)
                repaired += 1
            elif name.startswith("NEGOTIATE") and stack and not stack[-1][0].startswith("NEGOTIATE"):
                # a new negotiation while the last step's operation is open: that operation wrote no E (shown as
                # "Did Not Finish"); its step ended without its phases
                stack.clear()
                step_of[pid] = step + 1
                repaired += 1
            if not (name.startswith("NEGOTIATE") and stack and stack[-1][0].startswith("NEGOTIATE")):
                stack.append((name, ts))
        elif stack:  # an E without its B (the file started mid-step) is left out
            name, start = stack.pop()
            if stack or name.startswith("NEGOTIATE"):
                ops += _phase_op(name, start, ts, common)
            else:  # the operation itself closes: its E carries dtype and shape, and ends the step
                nbytes = _nbytes(e.get("args") or {})
                for op in ops:
                    if op.tensor == common["tensor"] and op.iteration == common["iteration"] and not op.nbytes:
                        op.nbytes = nbytes
                ops.append(Op(name=f"{name}.{tensor}", kind=OpKind.OTHER, phase="operation", nbytes=nbytes,
                              start_us=start, end_us=ts, args={"operation": kind_name}, **common))
                step_of[pid] = step + 1
    fused = _mark_fused(ops)
    trace = RankTrace(rank=rank, host=host, ops=sorted(ops, key=lambda o: o.start_us))
    tensors = sorted({names[p].partition(".")[2] or names[p] for p in names if is_step_tensor(names[p])})
    steps = max((n for p, n in step_of.items() if is_step_tensor(names[p])), default=0)
    trace.buckets = [Bucket(index=k, nbytes=sum(_tensor_bytes(ops, t) for t in group), params=group)
                     for k, group in enumerate(fused)]
    trace.meta.update({"source": "horovod timeline", "path": path, "truncated": truncated,
                       "unbalanced_events_mended": repaired})
    return HorovodTimeline(path, trace, tensors, steps, fused, ready, truncated)


def _phase_op(name: str, start: float, end: float, common: dict) -> list[Op]:
    """One phase inside a tensor's step: its negotiation, a queue or copy, or the library's transmission (none for
    an activity this reader does not know)."""
    label, times = f"{name}.{common['tensor']}", dict(start_us=start, end_us=end)
    if name.startswith("NEGOTIATE"):
        return [Op(name=label, kind=OpKind.QUEUE, phase="negotiate", **times, **common)]
    if name in QUEUE_PHASES:
        return [Op(name=label, kind=OpKind.QUEUE, phase=QUEUE_PHASES[name], **times, **common)]
    if name in COPY_PHASES:
        return [Op(name=label, kind=OpKind.COMM, phase=COPY_PHASES[name], **times, **common)]
    if LIB_OP.match(name):
        return [Op(name=label, kind=OpKind.COMM, phase="transmit", granularity="collective", **times, **common)]
    return []


# horovod.tensorflow's eager calls: the op has no node name in eager mode, so the timeline names the tensor by its
# op type, whatever name= said (dprorun's calibration after the window, a script's eager metric average)
EAGER_OP_NAMES = ("HorovodAllreduce", "HorovodAllgather", "HorovodBroadcast", "HorovodAlltoall",
                  "HorovodReducescatter")


def is_step_tensor(process_name: str) -> bool:
    """Whether a timeline tensor's operations are steps: not a broadcast (the initial parameters: "broadcast.<name>"
    from horovod.torch, "HorovodBroadcast_<name>" from horovod.tensorflow), not dprorun's own (calibration, the
    gather's), not an eager horovod.tensorflow call named by its op type (calibration included: 40 of them at the
    window's end, which, counted as steps, made every step span to the window's end in a whole-job timeline)."""
    kind, _, tensor = process_name.partition(".")
    name = tensor or process_name
    return kind != "broadcast" and not name.startswith("HorovodBroadcast") and "dprorun." not in process_name \
        and name not in EAGER_OP_NAMES


def _tensor_bytes(ops: list[Op], tensor: str) -> int:
    return max((op.nbytes for op in ops if op.tensor == tensor), default=0)


def _mark_fused(ops: list[Op]) -> list[list[str]]:
    """Group transmissions that start and end together (one fused response); returns the groups of the first
    step that has any allreduce, each a list of tensor names."""
    transmits = sorted((op for op in ops if op.phase == "transmit"), key=lambda o: (o.start_us, o.end_us))
    groups: list[list[Op]] = []
    for op in transmits:
        last = groups[-1][0] if groups else None
        if last is not None and abs(op.start_us - last.start_us) <= FUSED_TOLERANCE_US \
                and abs(op.end_us - last.end_us) <= FUSED_TOLERANCE_US and op.name.split(".")[0] == \
                last.name.split(".")[0]:
            groups[-1].append(op)
        else:
            groups.append([op])
    first_step: Optional[int] = None
    result: list[list[str]] = []
    for k, group in enumerate(groups):
        for op in group:
            op.txn_id = f"fused{k}"
            op.args["fused_tensors"] = len(group)
        allreduce = group[0].name.startswith(("GLOO_ALLREDUCE", "NCCL_ALLREDUCE", "MPI_ALLREDUCE"))
        if allreduce and first_step is None:
            first_step = group[0].iteration
        if allreduce and group[0].iteration == first_step:
            result.append([op.tensor for op in group])
    return result


def timeline_summary(timeline: HorovodTimeline) -> dict:
    """Per step: time in negotiation, queueing, fusion-buffer copies and transmission (sums over tensors,
    transmission counted once per fused response), and the step's span."""
    per_step: dict[int, dict[str, float]] = {}
    seen_txn: set = set()
    for op in timeline.trace.ops:
        if op.iteration < 0:
            continue
        row = per_step.setdefault(op.iteration, {"negotiate_ms": 0.0, "queue_ms": 0.0, "memcpy_ms": 0.0,
                                                 "transmit_ms": 0.0, "start": op.start_us, "end": op.end_us})
        row["start"], row["end"] = min(row["start"], op.start_us), max(row["end"], op.end_us)
        dur = op.dur_us / 1000
        if op.phase == "negotiate":
            row["negotiate_ms"] += dur
        elif op.kind is OpKind.QUEUE:
            row["queue_ms"] += dur
        elif op.phase in ("memcpy_in", "memcpy_out", "init_fusion_buffer"):
            row["memcpy_ms"] += dur
        elif op.phase == "transmit" and (op.iteration, op.txn_id) not in seen_txn:
            seen_txn.add((op.iteration, op.txn_id))
            row["transmit_ms"] += dur
    # a step some tensor's operation never closed (the file cut at exit, mid-step) is left out: every row a whole step
    steps = [{"step": s, "span_ms": round((r["end"] - r["start"]) / 1000, 3),
              **{k: round(v, 3) for k, v in r.items() if k.endswith("_ms")}} for s, r in sorted(per_step.items())
             if s < timeline.steps]
    return {"path": timeline.path, "tensors": len(timeline.tensors), "steps": timeline.steps,
            "unfinished_steps_left_out": len(per_step) - len(steps), "truncated": timeline.truncated,
            "fused_responses_first_step": len(timeline.fused_responses),
            "tensors_per_response": [len(g) for g in timeline.fused_responses], "per_step": steps}
