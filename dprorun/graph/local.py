"""The local DFG at op level: one rank's compute ops, phase by phase, from a profiled iteration.

The replay's compute chain per rank is a sequence of phases (forward, loss, backward cut at every bucket's
ready point, finalize, update, tail) whose durations come from the iterations that ran without the profiler.
An `OpProfile` holds, per phase, the ops the profiler recorded in it (the main thread's top-level ops, and the
autograd threads' in backward), each as a fraction [start, end) of the phase, with the time between ops as ops
of their own ("(between ops)": Python, hooks). Expanding a phase, or any slice of it, into its ops and scaling
them to the phase's unprofiled duration is how the replay graph gets op-level compute nodes (dPRO's local DFG):
the profiler inflates ops, so durations are calibrated phase by phase and the ratio is reported.

Scopes: a forward op is named with the innermost module whose forward ran it (`runtime/scopes.py`
annotations); a backward op with the module whose gradients become ready next (gradient order: the backward of
that module's layer, or what runs before it).
"""
from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from dprorun.stats import median
from dprorun.trace.model import Op, OpKind, RankTrace

PHASES = ("accumulate", "forward", "loss", "backward", "finalize", "update", "tail")
GAP_NAME = "(between ops)"
MIN_GAP_US = 5.0  # shorter gaps between two ops stay with the op before them
_PREFIXES = ("autograd::engine::evaluate_function: ", "torch::autograd::")
PROFILER_SOURCES = ("kineto", "xplane")  # torch.profiler's ops, the TensorFlow profiler's


@dataclass
class ProfiledOp:
    name: str
    kind: str  # OpKind value of the op (FW, BW, UPDATE, IO, OTHER)
    scope: str  # module name, "" when unknown
    start: float  # fraction of its phase
    end: float

    @property
    def label(self) -> str:
        return f"{self.name}@{self.scope}" if self.scope else self.name


@dataclass
class PhaseProfile:
    phase: str
    profiled_us: float  # the phase's length in the profiled iteration
    ops: list[ProfiledOp]  # in order, covering [0, 1]
    cuts: dict[str, float] = field(default_factory=dict)  # backward: bucket key -> fraction of its ready point

    def slice(self, a: float, b: float) -> list[tuple[ProfiledOp, float]]:
        """The ops overlapping [a, b] of the phase, each with its share of that slice (shares sum to 1); [] for
        an empty slice."""
        a, b = max(0.0, a), min(1.0, b)
        if b - a <= 1e-12:
            return []
        starts = [op.start for op in self.ops]
        first = max(0, bisect.bisect_right(starts, a) - 1)
        out = []
        for op in self.ops[first:]:
            if op.start >= b:
                break
            overlap = min(op.end, b) - max(op.start, a)
            if overlap > 0:
                out.append((op, overlap))
        total = sum(x for _, x in out)
        return [(op, x / total) for op, x in out] if total > 0 else []


@dataclass
class OpProfile:
    rank: int
    iteration: int  # the profiled iteration the ops come from
    phases: dict[str, PhaseProfile]

    @property
    def op_count(self) -> int:
        return sum(len(p.ops) for p in self.phases.values())


def short_name(name: str) -> str:
    for prefix in _PREFIXES:
        if name.startswith(prefix):
            name = name[len(prefix):]
    return name.replace("torch::autograd::", "")


def blocking_collectives(trace: RankTrace) -> bool:
    """Did each of the rank's collectives hold its thread from its start to its end (FSDP on the CPU:
    runtime/collectives.py)? Their time is then no compute, and the compute after each waits for it."""
    return any(t.get("blocking") for t in trace.meta.get("trackers", []))


def held_us(held: list[tuple[float, float]], a: float, b: float) -> float:
    """How much of [a, b] the intervals `held` (disjoint) cover."""
    return sum(max(0.0, min(e, b) - max(s, a)) for s, e in held)


def _windows(trace: RankTrace, iteration: int) -> Optional[tuple[dict[str, tuple[float, float]], dict[str, float]]]:
    """Per phase its [start, end] in the iteration, and each bucket's ready (hook call) time; None when the
    iteration lacks a forward, backward or update span."""
    spans: dict[OpKind, list[Op]] = {}
    enqueue: dict[str, float] = {}
    done: list[float] = []
    for op in trace.ops:
        if op.iteration != iteration:
            continue
        if op.stream == "phase":
            spans.setdefault(op.kind, []).append(op)
        elif op.source == "hooks" and op.tensor and op.kind in (OpKind.COMM, OpKind.QUEUE) \
                and op.phase in ("queue", "transmit", "queue+transmit"):
            enqueue[op.tensor] = min(enqueue.get(op.tensor, op.start_us), op.start_us)
            done.append(op.end_us)
    if not all(k in spans for k in (OpKind.FW, OpKind.BW, OpKind.UPDATE)):
        return None
    first, fw, bw, up = phase_spans(spans)
    end = next((e for i, _, e in trace.iterations if i == iteration), up.end_us)
    finalize_start = min(max([bw.end_us] + done), up.start_us)
    windows = {"accumulate": (first.start_us, fw.start_us),
               "forward": (fw.start_us, fw.end_us), "loss": (fw.end_us, max(fw.end_us, bw.start_us)),
               "backward": (bw.start_us, bw.end_us), "finalize": (finalize_start, up.start_us),
               "update": (up.start_us, up.end_us), "tail": (up.end_us, max(up.end_us, end))}
    return windows, enqueue


def phase_spans(spans: dict[OpKind, list[Op]]) -> tuple[Op, Op, Op, Op]:
    """(first forward, forward, backward, update) spans of an iteration whose spans hold all three kinds. Where the
    script accumulates gradients over micro-batches (DDP's no_sync: several forwards and backwards before the one
    that synchronises), the forward and backward are the last micro-batch's, and the ones before it, from the first
    forward's start to the last forward's start, are the iteration's "accumulate" phase (no bucket handed over)."""
    forwards, backwards = spans[OpKind.FW], spans[OpKind.BW]
    fw = forwards[-1]
    bw = next((b for b in backwards if b.start_us >= fw.end_us), backwards[-1]) if len(forwards) > 1 else backwards[0]
    after = [u for u in spans[OpKind.UPDATE] if u.start_us >= bw.end_us]
    if len(after) > 1:  # optimizers stepped one after another (a sparse table's, then the rest's): one update, from
        # the first's start (the first's step was read as DDP's finalize: an update of 1.05 ms where both took 2.89)
        return forwards[0], fw, bw, dataclasses.replace(after[-1], start_us=after[0].start_us)
    return forwards[0], fw, bw, spans[OpKind.UPDATE][-1]


def _phase_ops(ops: list[Op], a: float, b: float, scope_of) -> list[ProfiledOp]:
    """The ops inside [a, b] (clipped, made sequential) with the gaps between them, as fractions of [a, b]."""
    length = b - a
    if length <= 0:
        return []
    out: list[ProfiledOp] = []
    cursor = a
    for op in ops:
        start, end = max(op.start_us, a, cursor), min(op.end_us, b)
        if end <= start:
            continue
        gap = start - cursor
        if gap >= MIN_GAP_US or not out:
            if gap > 0:
                out.append(ProfiledOp(GAP_NAME, "OTHER", "", (cursor - a) / length, (start - a) / length))
        else:
            out[-1].end = (start - a) / length
        out.append(ProfiledOp(short_name(op.name), op.kind.value, scope_of(op), (start - a) / length,
                              (end - a) / length))
        cursor = end
    if cursor < b:
        if out and b - cursor < MIN_GAP_US:
            out[-1].end = 1.0
        else:
            out.append(ProfiledOp(GAP_NAME, "OTHER", "", (cursor - a) / length, 1.0))
    out[-1].end = 1.0
    return out


def op_profile(trace: RankTrace) -> Optional[OpProfile]:
    """The rank's op-level profile from its profiled (torch.profiler) iterations that have forward, backward and
    update spans (the first is left out when there are others: it holds the profiler's start). Per phase, the
    ops of the iteration of median length, each op's share averaged over the iterations that ran the same op
    sequence in that phase (one profiled iteration alone put 16 % of a Transformer's forward in one ReLU).
    None when the rank has no profiler ops."""
    compute_kinds = (OpKind.FW, OpKind.BW, OpKind.UPDATE, OpKind.IO, OpKind.OTHER)
    by_iteration: dict[int, list[Op]] = {}
    for op in trace.ops:
        if op.source in PROFILER_SOURCES and op.kind in compute_kinds and not op.device.startswith("cuda") \
                and (op.stream == "main" or op.stream.startswith("autograd:")):
            by_iteration.setdefault(op.iteration, []).append(op)
    candidates = [i for i in trace.meta.get("kineto_iterations", []) if by_iteration.get(i)] or sorted(by_iteration)
    if len(candidates) > 1:
        candidates = candidates[1:]
    lengths = {i: e - s for i, s, e in trace.iterations if i in candidates}
    candidates = [i for i in candidates if i in lengths and _windows(trace, i) is not None]
    if not candidates:
        return None
    typical = median([lengths[i] for i in candidates], 0.0)
    iteration = min(candidates, key=lambda i: abs(lengths[i] - typical))
    profiles = {i: _iteration_profile(trace, i, by_iteration[i]) for i in candidates}
    chosen = profiles[iteration]
    for phase, mine in chosen.items():
        names = [op.label for op in mine.ops]
        alike = [profiles[i][phase] for i in candidates if [op.label for op in profiles[i][phase].ops] == names]
        chosen[phase] = _averaged(alike)
    return OpProfile(trace.rank, iteration, chosen)


def _averaged(alike: list[PhaseProfile]) -> PhaseProfile:
    """One phase's profile with each op's duration (and each cut's time) the mean over iterations that ran the
    same ops, as fractions of the mean phase length."""
    first = alike[0]
    if len(alike) == 1:
        return first
    length = sum(p.profiled_us for p in alike) / len(alike)
    durations = [sum((p.ops[k].end - p.ops[k].start) * p.profiled_us for p in alike) / len(alike)
                 for k in range(len(first.ops))]
    total = sum(durations) or 1.0
    ops, cursor = [], 0.0
    for op, duration in zip(first.ops, durations):
        ops.append(ProfiledOp(op.name, op.kind, op.scope, cursor, cursor + duration / total))
        cursor += duration / total
    if ops:
        ops[-1].end = 1.0
    cuts = {key: sum(p.cuts.get(key, value) for p in alike) / len(alike) for key, value in first.cuts.items()}
    return PhaseProfile(first.phase, length, ops, cuts)


def _without_held(trace: RankTrace, iteration: int, windows: dict[str, tuple[float, float]], ops: list[Op],
                  enqueue: dict[str, float]) -> tuple[dict[str, tuple[float, float]], list[Op], dict[str, float]]:
    """Blocking collectives (`blocking_collectives`): the iteration's windows, ops and collectives' starts on a clock
    that stops while a collective holds the thread (the ops that ran inside one, the collective's own, gone)."""
    held = sorted((op.start_us, op.end_us) for op in trace.ops if op.iteration == iteration and op.source == "hooks"
                  and op.tensor and op.kind in (OpKind.COMM, OpKind.QUEUE))

    def squeezed(t: float) -> float:
        return t - held_us(held, float("-inf"), t)

    kept = []
    for op in ops:
        start, end = squeezed(op.start_us), squeezed(op.end_us)
        if end > start:
            kept.append(dataclasses.replace(op, start_us=start, end_us=end))
    return ({phase: (squeezed(a), squeezed(b)) for phase, (a, b) in windows.items()}, kept,
            {key: squeezed(t) for key, t in enqueue.items()})


def _iteration_profile(trace: RankTrace, iteration: int, iteration_ops: list[Op]) -> dict[str, PhaseProfile]:
    windows, enqueue = _windows(trace, iteration)
    ops = sorted(iteration_ops, key=lambda op: op.start_us)
    blocking = blocking_collectives(trace)
    in_forward = {key for key, t in enqueue.items() if t < windows["backward"][0]} if blocking else set()
    if blocking:
        windows, ops, enqueue = _without_held(trace, iteration, windows, ops, enqueue)
    ready = sorted((t, name) for i, name, t in trace.grad_ready if i == iteration)
    ready_times = [t for t, _ in ready]

    def scope_of(op: Op) -> str:
        scope = op.args.get("scope", "")
        if scope or op.kind is not OpKind.BW:
            return scope
        k = bisect.bisect_left(ready_times, op.end_us)  # the gradients that become ready next
        return ready[k][1].rsplit(".", 1)[0] if k < len(ready) and "." in ready[k][1] else ""

    phases = {}
    for phase in PHASES:
        a, b = windows[phase]
        inside = [op for op in ops if op.end_us > a and op.start_us < b
                  and (op.stream == "main" or phase in ("accumulate", "loss", "backward"))]
        phases[phase] = PhaseProfile(phase, b - a, _phase_ops(inside, a, b, scope_of))
    for phase, keys in (("backward", set(enqueue) - in_forward), ("forward", in_forward)):
        a, b = windows[phase]
        if b > a and keys:  # the forward: blocking collectives cut it (replay/measure.measure_rank)
            phases[phase].cuts = {key: min(1.0, max(0.0, (enqueue[key] - a) / (b - a))) for key in keys}
    return phases
