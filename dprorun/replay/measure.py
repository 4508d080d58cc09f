"""Measuring each rank's iterations into templates (`measure_rank`): the phases of every window iteration, each
bucket's rounds and their hand-overs on every rank (`iteration_slots`, `enqueues_over_ranks`), and per iteration
the template the replay takes (template.RankTemplate). A bucket's transmission time excludes waiting for the other
ranks and for the previous bucket: done - max(latest enqueue over all ranks, previous bucket's done on this rank),
on the aligned clock; a rank's wait before its forward for ranks whose step started later is theirs
(`_waited_before_forward`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from dprorun.fsutil import UnanswerableError
from dprorun.graph.local import blocking_collectives, held_us, phase_spans
from dprorun.replay.template import RankTemplate
from dprorun.stats import median
from dprorun.trace.model import OpKind, RankTrace


def iteration_slots(trace: RankTrace, iterations: list[int]) -> dict[int, dict]:
    """Per iteration: its phase spans by kind ("spans"), each bucket's last round: {"enqueue", "done"} ("comm") and
    all its rounds in order ("rounds"). A bucket all-reduced more than once in an iteration (micro-batches
    accumulated without no_sync) is modelled by its last round, the one the last backward hands over (the earlier
    ones are kept as measured, less the wait for later ranks before the forward: `_waited_before_forward`;
    trace/rundir.collectives_outside_buckets); the rounds were merged from the first's enqueue to the last's end,
    which put a late bucket's all-reduce at the last backward's start."""
    by_iter: dict[int, dict] = {i: {"spans": {}, "rounds": {}} for i in iterations}
    comm_ops = []
    for op in trace.ops:
        slot = by_iter.get(op.iteration)
        if slot is None:
            continue
        if op.stream == "phase":
            slot["spans"].setdefault(op.kind, []).append(op)
        elif op.source == "hooks" and op.tensor and op.kind in (OpKind.COMM, OpKind.QUEUE) \
                and op.phase in ("queue", "transmit", "queue+transmit"):
            comm_ops.append(op)
    for op in sorted(comm_ops, key=lambda o: o.start_us):
        rounds = by_iter[op.iteration]["rounds"].setdefault(op.tensor, [])
        if not rounds or op.start_us > rounds[-1]["done"]:  # a new round (a queue op ends where its transmit starts)
            rounds.append({"enqueue": op.start_us, "done": op.end_us})
        else:
            rounds[-1]["done"] = max(rounds[-1]["done"], op.end_us)
    for slot in by_iter.values():
        slot["comm"] = {key: rounds[-1] for key, rounds in slot["rounds"].items()}
        forwards = slot["spans"].get(OpKind.FW)
        slot["origin"] = forwards[0].start_us if forwards else None  # where the replay starts the rank's step
    return by_iter


@dataclass
class HandOvers:
    """Each round of each bucket in each iteration, keyed (iteration, bucket, round): when its last rank handed it
    over (`latest_us`, on the aligned clock), and the latest hand-over counted from where each rank began that
    round's work (`latest_own_us`: its step's start for a bucket's first round, the bucket's previous round's end for
    a later one): where the replay, which starts every rank's step at once, has the round go."""
    latest_us: dict[tuple[int, str, int], float] = field(default_factory=dict)
    latest_own_us: dict[tuple[int, str, int], float] = field(default_factory=dict)


def _own_time(slot: dict, rounds: list[dict], k: int) -> Optional[float]:
    """The time a rank took to hand round k over from where it began that round's work (`HandOvers`)."""
    begun = slot["origin"] if k == 0 else rounds[k - 1]["done"]
    return None if begun is None else rounds[k]["enqueue"] - begun


def enqueues_over_ranks(slots: dict[int, dict[int, dict]]) -> HandOvers:
    """The hand-overs of every round over ranks (`iteration_slots` per rank)."""
    out = HandOvers()
    for by_iteration in slots.values():
        for i, slot in by_iteration.items():
            for key, rounds in slot["rounds"].items():
                for k, c in enumerate(rounds):
                    out.latest_us[(i, key, k)] = max(out.latest_us.get((i, key, k), -np.inf), c["enqueue"])
                    own = _own_time(slot, rounds, k)
                    if own is not None:
                        out.latest_own_us[(i, key, k)] = max(out.latest_own_us.get((i, key, k), -np.inf), own)
    return out


def _waited_before_forward(slot: dict, i: int, before_us: float, hand_overs: HandOvers) -> float:
    """The part of what a rank did before `before_us` (its modelled forward) that the replay must not have, where
    earlier rounds of its buckets lie there (a GAN's first model stepped before the second's forward, SAM's first
    pass, LBFGS's closures, micro-batches all-reduced each): the rank's wait for later ranks' hand-overs, less the
    wait the replay has (`HandOvers.latest_own_us`). A rank late only because its step started
    late (the one before ended late there) made the others wait for time its own step does not hold: out (a
    Lightning GAN's per-iteration replays were up to 31 % over their iterations). A rank late from its own work
    makes them wait in the replay too: kept (SAM's early rank, busy longer after the round, had it taken out: -5.5
    %). A later round starts where the round before ended, on every rank: its wait is kept as measured (counted from
    the step's start, a late-started rank's lateness came back in each of LBFGS's closures: +10 %). Per round, the
    longest of its buckets' waits (they wait at once), each at most the round's length; negative where the
    replay's wait is the longer."""
    waited: dict[int, float] = {}
    replayed: dict[int, float] = {}
    for key, rounds in slot["rounds"].items():
        for k, c in enumerate(rounds[:-1]):
            if c["enqueue"] >= before_us:
                continue
            length = c["done"] - c["enqueue"]
            wait = max(0.0, hand_overs.latest_us.get((i, key, k), c["enqueue"]) - c["enqueue"])
            waited[k] = max(waited.get(k, 0.0), min(wait, length))
            own = _own_time(slot, rounds, k)
            if own is not None:
                wait = max(0.0, hand_overs.latest_own_us.get((i, key, k), own) - own)
                replayed[k] = max(replayed.get(k, 0.0), min(wait, length))
    return sum(waited.values()) - sum(replayed.values())


def _eager_tf_steps(trace: RankTrace) -> str:
    """Why a TensorFlow worker's steps have no phases: they ran eagerly (Keras's run_eagerly=True, strategy.run
    outside any tf.function), and its profile names each op by its type alone, no gradient scope among them."""
    if any(t.get("framework") == "tf" and t.get("eager_steps") for t in trace.meta.get("trackers", [])):
        return (": the TensorFlow steps ran eagerly (run_eagerly=True, or strategy.run outside a tf.function), "
                "whose profile names each op by its type alone, with no gradient scope to tell the backward by; the "
                "run's own iterations are measured (dpro summary), not replayed: compile the step (tf.function, "
                "Keras's default) for a replay")
    return ""


def _tf_profiler_off(trace: RankTrace) -> str:
    """Why a TensorFlow worker's steps have no phases: TensorFlow's profiler, their only source, was off
    (--no-kineto, or dprorun's last launch after the profiler's stop had crashed a worker in every profiled one)."""
    tf = any(t.get("framework") == "tf" or t.get("tf") for t in trace.meta.get("trackers", []))
    if tf and not trace.meta.get("window", {}).get("kineto", True):
        return (": TensorFlow's profiler, the only source of a worker's forward, backward and update, was off in this "
                "launch (--no-kineto, or dprorun's last launch after TensorFlow's profiler stop crashed a worker "
                "in each profiled one, a TensorFlow defect): the run's own iterations are measured (dpro summary), "
                "not replayed; launch the job again for a replay")
    return ""


def _backward_inside_forward(slots: dict[int, dict]) -> str:
    """Why an iteration has no backward span, where its buckets were handed over inside its DDP model's forward: the
    model's forward runs the backward and the optimizer steps itself (Lightning's manual optimization, whose
    training_step runs inside the DDP wrapper and returns no loss)."""
    for slot in slots.values():
        forwards = slot["spans"].get(OpKind.FW, [])
        if slot["spans"].get(OpKind.BW) or not forwards or not slot["comm"]:
            continue
        if any(f.start_us <= c["enqueue"] <= f.end_us for f in forwards for c in slot["comm"].values()):
            return (": the gradients were all-reduced inside the DDP model's forward, which runs the backward and "
                    "the optimizer steps itself (Lightning's manual optimization: training_step runs inside the DDP "
                    "wrapper and returns no loss), and the replay reads a forward, then a backward, then an update; "
                    "the run's own iterations are measured (dpro summary), not replayed")
    return ""


def own_comm_hook(trace: RankTrace) -> bool:
    """The rank's DDP buckets were timed by the comm hook dprorun registered (no user hook, not Horovod)."""
    trackers = trace.meta.get("trackers", [])
    return bool(trackers) and all(t.get("framework", "ddp") == "ddp" and t.get("timed_buckets")
                                  and not t.get("user_comm_hook") for t in trackers)


def measure_rank(trace: RankTrace, iterations: list[int], hand_overs: HandOvers, channels: int = 1,
                 slots: Optional[dict[int, dict]] = None) -> tuple[RankTemplate, dict[int, RankTemplate],
                                                                  dict[int, dict[str, float]]]:
    """The rank's median template, its per-iteration templates, and per-iteration bucket transmission times.

    When the buckets were timed through dprorun's own comm hook (the job itself leaves DDP's built-in C++
    all-reduce in place), each hook call's main-thread cost (Python, and the division DDP otherwise fuses into
    its bucket copy) is profiler overhead: it is taken out of the backward segment that holds it, and no
    per-bucket cost is added back in what-ifs. On a 20 ms loopback MLP step with 7 buckets it was 0.7 ms."""
    ends = {i: e for i, s, e in trace.iterations}
    starts = {i: s for i, s, e in trace.iterations}
    blocking = blocking_collectives(trace)  # FSDP on the CPU: `_blocking_sample`
    # a sharded step's gathers (ZeRO by hand), run after its update
    after_update = set() if blocking else {b.key for b in trace.buckets
                                           if b.collective == "all_gather" and not b.gathers_gradients}
    enqueue_cost = median([op.args.get("enqueue_cost_us", 0.0) for op in trace.ops if op.args.get("enqueue_cost_us")],
                          0.0)
    hook_overhead = enqueue_cost if own_comm_hook(trace) else 0.0
    samples: dict[int, RankTemplate] = {}
    transmit: dict[int, dict[str, float]] = {}
    slots = iteration_slots(trace, iterations) if slots is None else slots
    for i, slot in slots.items():
        spans = slot["spans"]
        if not all(k in spans for k in (OpKind.FW, OpKind.BW, OpKind.UPDATE)):
            continue
        first, fw, bw, up = phase_spans(spans)
        every = sorted(slot["comm"].items(), key=lambda kv: kv[1]["enqueue"])
        samples[i] = (_blocking_sample(trace.rank, first, fw, bw, up, every, starts[i], ends[i]) if blocking else
                      _overlapped_sample(trace.rank, first, fw, bw, up, every, after_update, enqueue_cost,
                                         hook_overhead, starts[i], ends[i],
                                         _waited_before_forward(slot, i, fw.start_us, hand_overs)))
        free = [-np.inf] * channels  # when each of the backend's parallel channels is free (gloo: 2 worker threads)
        transmit[i] = {}
        for key, c in every:
            everyone = hand_overs.latest_us.get((i, key, len(slot["rounds"][key]) - 1), c["enqueue"])
            k = int(np.argmin(free))
            transmit[i][key] = max(1.0, c["done"] - max(everyone, free[k]))
            free[k] = c["done"]
    if not samples:
        why = _eager_tf_steps(trace) or _tf_profiler_off(trace) or _backward_inside_forward(slots)
        raise UnanswerableError(f"rank {trace.rank}: no profiled iteration has forward, backward and update spans{why}")
    orders = [tuple(t.bucket_ready_order) for t in samples.values()]
    order = max(set(orders), key=orders.count)
    same = [t.backward_segments_us for t in samples.values() if tuple(t.bucket_ready_order) == order]
    gathered = [tuple(t.gathered) for t in samples.values()]
    values = list(samples.values())

    def med(attr: str) -> float:
        return median([getattr(t, attr) for t in values], 0.0)

    template = RankTemplate(rank=trace.rank, accumulate_us=med("accumulate_us"), forward_us=med("forward_us"),
                            loss_us=med("loss_us"),
                            backward_segments_us=[float(x) for x in np.median(np.array(same), axis=0)],
                            bucket_ready_order=list(order), update_us=med("update_us"), tail_us=med("tail_us"),
                            enqueue_cost_us=enqueue_cost - hook_overhead, backward_us=med("backward_us"),
                            iterations_used=len(values), measured_iteration_us=med("measured_iteration_us"),
                            finalize_us=med("finalize_us"),
                            gathered=list(max(gathered, key=gathered.count)) if gathered else [],
                            **_median_forward_cut(values))
    return template, samples, transmit


def _overlapped_sample(rank: int, first, fw, bw, up, every: list[tuple[str, dict]], after_update: set[str],
                       enqueue_cost: float, hook_overhead: float, start: float, end: float,
                       waited_us: float = 0.0) -> RankTemplate:
    """One iteration of a rank whose collectives run beside its compute (DDP's buckets, the script's own calls):
    the backward cut where each gradient collective was handed over (DDP's hook: its cost out of the segment it
    starts, `hook_overhead`), a sharded step's gathers after the update (`after_update`), the time it waited for
    other ranks before its forward that the replay does not have (`waited_us`: `_waited_before_forward`) out of
    what it did before it."""
    comm = [(key, c) for key, c in every if key not in after_update]  # the gradients' collectives
    gathers_done = max([c["done"] for key, c in every if key in after_update], default=up.end_us)
    cuts = [bw.start_us] + [min(max(c["enqueue"], bw.start_us), bw.end_us) for _, c in comm] + [bw.end_us]
    last_done = max([c["done"] for _, c in comm], default=bw.end_us)
    segments = [b - a for a, b in zip(cuts, cuts[1:])]
    removed = 0.0
    for k in range(1, len(segments)):  # segment k starts with bucket k-1's hook call
        cut = min(hook_overhead, segments[k])
        segments[k] -= cut
        removed += cut
    return RankTemplate(
        rank=rank, accumulate_us=max(0.0, fw.start_us - first.start_us - waited_us), forward_us=fw.dur_us,
        loss_us=max(0.0, bw.start_us - fw.end_us),
        backward_segments_us=segments, bucket_ready_order=[k for k, _ in comm],
        update_us=up.dur_us, tail_us=max(0.0, end - max(up.end_us, gathers_done)),
        enqueue_cost_us=enqueue_cost - hook_overhead,
        backward_us=bw.dur_us - removed, iterations_used=1, measured_iteration_us=end - start,
        finalize_us=max(0.0, up.start_us - max(bw.end_us, last_done)),
        gathered=[key for key, _ in every if key in after_update])


def _median_forward_cut(values: list[RankTemplate]) -> dict:
    """The forward's blocking calls in their most common order, and its segments' medians over the iterations
    that made them in that order (RankTemplate.forward_order)."""
    orders = [tuple(t.forward_order) for t in values]
    order = max(set(orders), key=orders.count) if orders else ()
    if not order:
        return {}
    same = [t.forward_segments_us for t in values if tuple(t.forward_order) == order]
    return {"forward_order": list(order),
            "forward_segments_us": [float(x) for x in np.median(np.array(same), axis=0)]}


def _blocking_sample(rank: int, first, fw, bw, up, every: list[tuple[str, dict]], start: float,
                     end: float) -> RankTemplate:
    """One iteration of a rank whose collectives each held its thread from start to end (FSDP on the CPU: the
    forward's and the backward's gathers, the backward's reduce-scatters): their time taken out of the phases they
    ran in, the forward's and the backward's compute cut at them: each call hands over where it was made and the
    compute after it waits for it (replay/local_dfg.py), so every call meets the ranks again as it did."""
    held = sorted((c["enqueue"], c["done"]) for _, c in every)

    def compute(a: float, b: float) -> float:
        return max(0.0, b - a - held_us(held, a, b))

    def cut(a: float, b: float, calls: list[tuple[str, dict]]) -> list[float]:
        """The compute of [a, b] between its calls (each cut at its start, clamped into [a, b])."""
        bounds = [a] + [min(max(c["enqueue"], a), b) for _, c in calls] + [b]
        return [compute(x, y) for x, y in zip(bounds, bounds[1:])]

    in_forward = [(key, c) for key, c in every if c["enqueue"] < bw.start_us]
    in_backward = [(key, c) for key, c in every if c["enqueue"] >= bw.start_us]
    forward, backward = cut(fw.start_us, fw.end_us, in_forward), cut(bw.start_us, bw.end_us, in_backward)
    return RankTemplate(
        rank=rank, accumulate_us=compute(first.start_us, fw.start_us), forward_us=sum(forward),
        loss_us=compute(fw.end_us, max(fw.end_us, bw.start_us)), backward_segments_us=backward,
        bucket_ready_order=[key for key, _ in in_backward], update_us=compute(up.start_us, up.end_us),
        tail_us=compute(up.end_us, end), enqueue_cost_us=0.0, backward_us=sum(backward), iterations_used=1,
        measured_iteration_us=end - start, finalize_us=compute(bw.end_us, up.start_us),
        forward_order=[key for key, _ in in_forward], forward_segments_us=forward)
