"""Reader of the TensorFlow profiler's XSpace (`.xplane.pb`) into trace-model ops, without TensorFlow.

The file is a protobuf `XSpace` (tsl/profiler/protobuf/xplane.proto): planes of lines (threads) of events, each
event naming its metadata (op name) and carrying stats (key/value pairs named by stat metadata). It is decoded
here from the protobuf wire format directly, so the analysis does not need TensorFlow installed. Used fields:
  XSpace: planes (1), hostnames (4)
  XPlane: name (2), lines (3), event_metadata map (4), stat_metadata map (5), stats (6)
  XLine: name (2), timestamp_ns (3), events (4)
  XEvent: metadata_id (1), offset_ps (2), duration_ps (3), stats (4)
  XStat: metadata_id (1), double (2), uint64 (3), int64 (4), str (5), bytes (6), ref (7: a stat metadata id
         whose name is the value)
  XEventMetadata / XStatMetadata: id (1), name (2)
Times: the host plane's events are relative to the profile's start; the "Task Environment" plane's
`profile_start_time` stat holds that start in epoch nanoseconds, so an event starts at profile_start_time +
line.timestamp_ns + offset_ps / 1000 (ns), on the worker's wall clock.

Produced (host plane "/host:CPU"):
  - compute ops: events named "<op name>:<op type>" on the executor threads (`tf_Compute`, `tf_inter_op`):
    name = op type, `args["scope"]` = the op name's scope (e.g. "sequential/dense"), kind FW/BW/UPDATE by
    position in the step (the caller decides; here BW for `gradient_tape/` and `gradients/` ops, FW otherwise);
  - collectives: `CollectiveReduceV2` (and other `Collective*` ops) on `collective_ops` threads, kind COMM,
    phase "transmit", txn_id "tf.instance<instance_key>", with group key and step id, and the bytes of the
    buffer allocated inside it (the MemoryAllocation event's requested_bytes);
  (horovod.tensorflow: TensorFlow's profiler records none of Horovod's asynchronous ops; their spans come from
  Horovod's timeline, trace/tf_records.add_tf_records);
  - fetches: the starts of `IteratorGetNextOp::DoCompute` (a step function's `next(iterator)`, once per step),
    which split a call that runs several steps (tf_records.split_multi_step_calls);
  - ops inside a loop of the step function keep the names they were traced with (`name_outside_loop`);
  - steps: the python thread's `train` events (`tf.profiler.experimental.Trace("train", step_num=N)`), where a
    script set them (dprorun sets none: it splits the profile at its own step boundaries).
"""
from __future__ import annotations

import re
import struct
from dataclasses import dataclass, field
from typing import Any, Iterator

from dprorun.fsutil import TraceError
from dprorun.trace.model import Op, OpKind

COMPUTE_THREADS = ("tf_Compute", "tf_inter_op")
# a GradientTape's ops; "gradients/": the gradient of a function op (a recurrent layer's while loop, a call)
GRADIENT_SCOPES = ("gradient_tape/", "gradients/")
FETCH_EVENT = "IteratorGetNextOp::DoCompute"  # a step function's `next(iterator)`: once at each step's start
COLLECTIVE_THREADS = ("collective_ops",)
SKIPPED_PREFIXES = ("ThreadpoolListener", "Memory", "ExecutorState::", "ExecutorDoneCallback", "ParallelFor",
                    "CollectiveOpV2Kernel", "Loop")


class _Truncated(Exception):
    pass


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise _Truncated()
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
        if shift > 70:
            raise ValueError("varint too long")


def _fields(buf: bytes, start: int = 0, end: int = -1) -> Iterator[tuple[int, int, Any]]:
    """(field number, wire type, value) of each field in buf[start:end]; length-delimited values as (a, b)
    offsets into buf, fixed-width ones as raw bytes."""
    end = len(buf) if end < 0 else end
    pos = start
    while pos < end:
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire == 2:
            length, pos = _varint(buf, pos)
            if pos + length > end:
                raise _Truncated()
            value, pos = (pos, pos + length), pos + length
        elif wire == 1:
            if pos + 8 > end:
                raise _Truncated()
            value, pos = buf[pos:pos + 8], pos + 8
        elif wire == 5:
            if pos + 4 > end:
                raise _Truncated()
            value, pos = buf[pos:pos + 4], pos + 4
        else:
            raise ValueError(f"unsupported wire type {wire}")
        yield number, wire, value


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _text(buf: bytes, span: tuple[int, int]) -> str:
    return buf[span[0]:span[1]].decode("utf-8", "replace")


@dataclass
class XEvent:
    name: str
    start_ns: float
    duration_ns: float
    stats: dict[str, Any]
    thread: str

    @property
    def end_ns(self) -> float:
        return self.start_ns + self.duration_ns


@dataclass
class XSpace:
    path: str
    hostnames: list[str]
    profile_start_ns: int
    events: list[XEvent] = field(default_factory=list)  # the host plane's, every thread


def _stat(buf: bytes, span: tuple[int, int], stat_names: dict[int, str]) -> tuple[str, Any]:
    name, value = "", None
    for number, _, raw in _fields(buf, *span):
        if number == 1:
            name = stat_names.get(raw, str(raw))
        elif number == 2:
            value = struct.unpack("<d", raw)[0]
        elif number in (3, 7):
            value = stat_names.get(raw, raw) if number == 7 else raw
        elif number == 4:
            value = _signed(raw)
        elif number in (5, 6):
            value = _text(buf, raw)
    return name, value


def _metadata(buf: bytes, span: tuple[int, int]) -> tuple[int, str]:
    """(key, name) of a map entry whose value is an XEventMetadata or XStatMetadata."""
    key, name = 0, ""
    for number, _, raw in _fields(buf, *span):
        if number == 1:
            key = _signed(raw)
        elif number == 2:
            for inner, _, value in _fields(buf, *raw):
                if inner == 2:
                    name = _text(buf, value)
    return key, name


def _plane(buf: bytes, span: tuple[int, int]) -> tuple[str, list, dict, dict, list]:
    name, lines, event_names, stat_names, stats = "", [], {}, {}, []
    for number, _, raw in _fields(buf, *span):
        if number == 2:
            name = _text(buf, raw)
        elif number == 3:
            lines.append(raw)
        elif number == 4:
            key, value = _metadata(buf, raw)
            event_names[key] = value
        elif number == 5:
            key, value = _metadata(buf, raw)
            stat_names[key] = value
        elif number == 6:
            stats.append(raw)
    return name, lines, event_names, stat_names, stats


def read_xspace(path: str) -> XSpace:
    """The host plane's events of one `.xplane.pb` (TraceError for a file that is not one, or cut short)."""
    try:
        with open(path, "rb") as handle:
            buf = handle.read()
    except OSError as exc:
        raise TraceError(path, f"unreadable ({exc.strerror})") from None
    try:
        planes, hostnames = [], []
        for number, wire, raw in _fields(buf):
            if number == 1 and wire == 2:
                planes.append(_plane(buf, raw))
            elif number == 4 and wire == 2:
                hostnames.append(_text(buf, raw))
        start_ns = None
        for name, _, _, stat_names, stats in planes:
            for span in stats:
                key, value = _stat(buf, span, stat_names)
                if key == "profile_start_time":
                    start_ns = int(value)
        host = next((p for p in planes if p[0] == "/host:CPU"), None)
        if host is None:
            raise TraceError(path, "not a TensorFlow profile with a host plane (/host:CPU)")
        if start_ns is None:
            raise TraceError(path, "no profile_start_time: the profile's start on the worker's clock is unknown")
        space = XSpace(path, hostnames, start_ns)
        _, lines, event_names, stat_names, _ = host
        for line in lines:
            thread, base_ns, events = "", 0, []
            for number, _, raw in _fields(buf, *line):
                if number == 2:
                    thread = _text(buf, raw)
                elif number == 3:
                    base_ns = _signed(raw)
                elif number == 4:
                    events.append(raw)
            for event in events:
                meta, offset_ps, duration_ps, stats = 0, 0, 0, {}
                for number, _, raw in _fields(buf, *event):
                    if number == 1:
                        meta = _signed(raw)
                    elif number == 2:
                        offset_ps = _signed(raw)
                    elif number == 3:
                        duration_ps = _signed(raw)
                    elif number == 4:
                        key, value = _stat(buf, raw, stat_names)
                        stats[key] = value
                space.events.append(XEvent(event_names.get(meta, str(meta)),
                                           start_ns + base_ns + offset_ps / 1000.0, duration_ps / 1000.0, stats,
                                           thread.split("/", 1)[0]))
    except _Truncated:
        raise TraceError(path, "cut short (the profile was not written completely): read nothing from it") from None
    except (ValueError, UnicodeError, struct.error) as exc:
        raise TraceError(path, f"not a TensorFlow XSpace protobuf ({exc})") from None
    space.events.sort(key=lambda e: e.start_ns)
    return space


@dataclass
class TFProfile:
    """One worker's profile in the trace model (times in epoch µs)."""

    compute: list[Op]
    collectives: list[Op]
    steps: list[tuple[int, float, float]]  # (step_num, start, end)
    fetches: list[float] = field(default_factory=list)  # starts of the step functions' input fetches (GetNext)


LOOP_BODY = re.compile(r"^(?:while(?:_\d+)?/body/_\d+/)+")


def name_outside_loop(op_name: str) -> str:
    """An op's name as the step function traced it, where the function runs its steps in a loop (Keras's
    steps_per_execution, a custom loop's tf.range): the executed loop body prefixes "while/body/_N/" and the
    loop's own scope ("gradient_tape/while/sequential/..." for "gradient_tape/sequential/...")."""
    found = LOOP_BODY.match(op_name)
    if found is None:
        return op_name
    rest = op_name[found.end():]
    if rest.startswith("gradient_tape/while/"):
        return "gradient_tape/" + rest[len("gradient_tape/while/"):]
    return rest[len("while/"):] if rest.startswith("while/") else rest


def read_tf_profile(path: str, rank: int, shift_us: float = 0.0) -> TFProfile:
    """The worker's profile; `shift_us` moves every time (the hooks' test clock skew, which TensorFlow's
    profiler does not see)."""
    space = read_xspace(path)
    compute, collectives, steps, fetches = [], [], [], []
    allocations = [e for e in space.events if e.name == "MemoryAllocation" and e.thread in COLLECTIVE_THREADS]
    for event in space.events:
        start, end = event.start_ns / 1000.0 + shift_us, event.end_ns / 1000.0 + shift_us
        if event.thread == "python" and event.name == "train" and "step_num" in event.stats:
            steps.append((int(event.stats["step_num"]), start, end))
        elif event.name == FETCH_EVENT:
            fetches.append(start)
        elif event.thread in COLLECTIVE_THREADS and ":Collective" in event.name:
            inside = [a for a in allocations if event.start_ns <= a.start_ns <= event.end_ns]
            nbytes = int(inside[0].stats.get("requested_bytes", 0)) if inside else 0
            key = event.stats.get("instance_key")
            op_name, op_type = event.name.rsplit(":", 1)
            op_name = name_outside_loop(op_name)
            collectives.append(Op(name=op_type, kind=OpKind.COMM, rank=rank, start_us=start, end_us=end,
                                  stream="comm:tf", source="xplane", phase="transmit", granularity="collective",
                                  nbytes=nbytes, txn_id=f"tf.instance{key}",
                                  args={"scope": op_name, "instance_key": key,
                                        "group_key": event.stats.get("group_key"),
                                        "step_id": event.stats.get("step_id")}))
        elif event.thread in COMPUTE_THREADS and ":" in event.name and not event.name.startswith(SKIPPED_PREFIXES):
            op_name, op_type = event.name.rsplit(":", 1)
            op_name = name_outside_loop(op_name)
            scope = op_name.rsplit("/", 1)[0] if "/" in op_name else ""
            kind = OpKind.BW if op_name.startswith(GRADIENT_SCOPES) else OpKind.FW
            compute.append(Op(name=op_type, kind=kind, rank=rank, start_us=start, end_us=end, stream="main",
                              source="xplane", args={"scope": scope, "op": op_name}))
    return TFProfile(compute, collectives, sorted(steps), sorted(fetches))
