"""Predictions: the job as it ran, and what-if variants (world size, bandwidth, latency, bucket size,
tensor partitions), by synthesising a replay graph from the measured templates and replaying it.

Per rank: forward -> loss -> backward segments (each bucket's In after the segment in which its last gradient
became ready, plus the hook's enqueue cost) -> update (after every bucket's Out) -> tail. Per bucket and
partition: a ring all-reduce, 2(N-1) steps; at each step every rank's SEND occupies its outgoing link
(`link r->r+1`) for one step time and the receiver's RECV (no device) joins it; the next step needs both the
rank's own SEND and RECV. Modelled steps (what-ifs) of a backend with several channels (gloo) are split in two: the step latency on one
of the backend's channels (`channel r->r+1`, as many slots as the backend runs collectives at once) and the bytes on the link,
which concurrent collectives share (one slot): two collectives in flight overlap their latencies, not their
bandwidth. With no flags the measured buckets and transmission times are replayed; flags that
change sizes or N use the fitted cost model, scaled to match the measured transmissions.
The Daydream-style baseline replaces each bucket's synchronisation by one op of bytes / bandwidth on the
rank's own comm device, with no cross-rank dependency.
"""
from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from fnmatch import fnmatchcase
from typing import Optional

import numpy as np

from dprorun.graph.local import OpProfile, ProfiledOp
from dprorun.replay.engine import GraphBuilder, ReplayGraph, ReplayResult, critical_path_report, replay
from dprorun.replay.template import JobModel, MeasuredIteration, build_job_model, ddp_buckets, horovod_knobs_as_run
from dprorun.fsutil import UnanswerableError

MB = 1 << 20


@dataclass
class WhatIf:
    world_size: Optional[int] = None
    bandwidth_gbit: Optional[float] = None  # absolute link bandwidth
    bandwidth_scale: float = 1.0
    latency_us: Optional[float] = None  # per ring step
    bucket_mb: Optional[float] = None
    partitions: int = 1
    buckets: Optional[list[list[str]]] = None  # explicit grouping (the optimizer's tensor fusion)
    bucket_partitions: dict[str, int] = field(default_factory=dict)  # per bucket key ("bucket3"): pieces
    accumulation_steps: int = 1  # micro-batches per optimizer step (same global batch)
    recompute_segments: int = 0  # activation checkpointing in this many segments (0: none)
    horovod_fusion_mb: Optional[float] = None  # Horovod: fusion threshold (0: no fusion)
    horovod_cycle_ms: Optional[float] = None  # Horovod: cycle time
    forward_scale: float = 1.0  # model forward time x this (op fusion / precision, from measured variants)
    backward_scale: float = 1.0  # model backward compute x this
    # compiled regions: each group's gradients become ready together, at its latest (a region's backward is one
    # graph): [every parameter] for a compiled model (no overlap with backward), one group per compiled block
    ready_groups: Optional[list[list[str]]] = None
    # per-op what-if: profiled ops whose name, module scope or name@scope matches the glob pattern take x factor
    op_scale: dict[str, float] = field(default_factory=dict)
    baseline: str = "dpro"  # or "daydream"

    # the questions that change what is communicated or when (the one place that knows it)
    COMMUNICATION_FIELDS = frozenset({"world_size", "bucket_mb", "buckets", "partitions", "bucket_partitions",
                                      "horovod_fusion_mb", "horovod_cycle_ms", "ready_groups",
                                      "accumulation_steps"})

    def asked(self) -> set[str]:
        """The fields that ask something (differ from the job as it ran); `baseline` is how, not what."""
        changed = set()
        for spec in fields(self):
            default = spec.default_factory() if spec.default_factory is not MISSING else spec.default
            value = getattr(self, spec.name)
            if spec.name != "baseline" and value != default and not (value in (None, {}, []) and not default):
                changed.add(spec.name)
        return changed

    def is_identity(self) -> bool:
        return not self.asked()

    def changes_communication(self) -> bool:
        return bool(self.asked() & self.COMMUNICATION_FIELDS)

    def pieces(self, bucket_key: str) -> int:
        return max(1, int(self.bucket_partitions.get(bucket_key, self.partitions)))

    def op_factor(self, op: ProfiledOp) -> float:
        """The factor `op_scale` gives a profiled op (the product of every pattern it matches; 1 if none)."""
        factor = 1.0
        for pattern, value in self.op_scale.items():
            if fnmatchcase(op.name, pattern) or (op.scope and fnmatchcase(op.scope, pattern)) \
                    or fnmatchcase(op.label, pattern):
                factor *= value
        return factor


@dataclass
class Prediction:
    predicted_iteration_time_ms: float
    world_size: int
    buckets: int
    baseline: str
    measured_iteration_time_ms: Optional[float]
    critical_path: dict
    device_utilisation: dict
    comm_model: dict
    replay_ops: int
    replay_time_s: float
    engine: str
    whatif: dict
    notes: list[str] = field(default_factory=list)
    spread_ms: Optional[list[float]] = None  # p10, p90 over the per-iteration replays
    self_check: Optional[dict] = None  # the job as it ran: replay vs the run's clean iterations (see self_check)

    def to_json(self) -> dict:
        return asdict(self)


MIN_CLEAN_ITERATIONS = 5


def _band_ms(values_us) -> tuple[float, float, float]:
    """(median, p10, p90) in ms."""
    values = np.asarray(values_us, dtype=float) / 1000
    return float(np.median(values)), float(np.percentile(values, 10)), float(np.percentile(values, 90))


def self_check(model: JobModel, as_run_replays_us) -> dict:
    """Compare the replay of the job as it ran with the run's clean iterations (no profiling, nothing of
    dprorun's running): agree when the medians differ by no more than the wider half p10-p90 band of either
    (the run's own spread) or 2 %. Where they disagree, say which one the prediction follows (the profiled
    window: it is what the replay is built from) and why, from the window's own measured iterations."""
    replay, replay_lo, replay_hi = _band_ms(as_run_replays_us)
    check = {"replay_ms": round(replay, 3), "replay_p10_p90_ms": [round(replay_lo, 3), round(replay_hi, 3)],
             "clean_iterations": len(model.clean_iterations_us)}
    if model.window_iterations_us:
        check["window_ms"] = round(_band_ms(model.window_iterations_us)[0], 3)
    if len(model.clean_iterations_us) < MIN_CLEAN_ITERATIONS:
        check.update(status="unchecked", message=(
            f"only {len(model.clean_iterations_us)} clean iteration(s) after the window (need "
            f"{MIN_CLEAN_ITERATIONS}): the replay could not be checked against the job without profiling; "
            "run more steps, or raise --clean"))
        return check
    clean, clean_lo, clean_hi = _band_ms(model.clean_iterations_us)
    tolerance = max((clean_hi - clean_lo) / 2, (replay_hi - replay_lo) / 2, 0.02 * clean)
    difference = replay - clean
    check.update(clean_ms=round(clean, 3), clean_p10_p90_ms=[round(clean_lo, 3), round(clean_hi, 3)],
                 difference_pct=round(100 * difference / clean, 2), tolerance_ms=round(tolerance, 3))
    if abs(difference) <= tolerance:
        check.update(status="agrees", message=(
            f"self-check: the replay of the job as it ran ({replay:.2f} ms) agrees with the run's "
            f"{len(model.clean_iterations_us)} clean iterations ({clean:.2f} ms, p10-p90 {clean_lo:.2f}-"
            f"{clean_hi:.2f})"))
        return check
    window = check.get("window_ms")
    if window is not None and abs(replay - window) <= tolerance:
        why = (f"the window's own iterations ran at {window:.2f} ms: the job ran at another speed under the hooks "
               "than without them (their cost, or what else ran on the machine then)")
    else:
        why = (f"the replay also misses the window's own iterations ({window:.2f} ms): a modelling error"
               if window is not None else "the window's iterations were not measured")
    check.update(status="disagrees", message=(
        f"warning: the replay of the job as it ran ({replay:.2f} ms) differs from the run's "
        f"{len(model.clean_iterations_us)} clean iterations ({clean:.2f} ms, p10-p90 {clean_lo:.2f}-{clean_hi:.2f}) "
        f"by {100 * difference / clean:+.1f} %, more than the run's own spread (±{tolerance:.2f} ms); the "
        f"prediction follows the profiled window, from which it is built: {why}"))
    return check


@dataclass
class _Sync:
    key: str
    nbytes: int
    ready_fraction: float
    measured_us: Optional[float]
    delay_us: float = 0.0  # after its ready point, before it can start (Horovod: cycle negotiation)


def horovod_fusion(model: JobModel, threshold_bytes: float, cycle_us: float) -> list[tuple[list[str], float, float]]:
    """Horovod's tensor fusion, as its background loop does it: every `cycle_us` the tensors that became ready
    since the last cycle are negotiated (one round among the ranks per cycle) and fused, in ready order, into
    responses of at most `threshold_bytes`. Returns each response's tensors, its ready fraction of the backward
    pass (the end of the cycle that picked it up, capped at the end of backward) and the delay after that
    point before it can start: the cycle's negotiation (`JobModel.horovod_negotiation_us`) plus the part of the
    cycle that runs past the end of backward."""
    backward = float(np.median([t.backward_us for t in model.templates.values()])) or 1.0
    negotiation = model.horovod_negotiation_us
    order = sorted(model.param_ready_fraction, key=model.param_ready_fraction.get)
    responses: list[tuple[list[str], float, float]] = []
    current: list[str] = []
    size = 0.0
    current_cycle, current_end, current_delay = None, 1.0, negotiation
    for name in order:
        ready_us = model.param_ready_fraction[name] * backward
        cycle = int(ready_us // cycle_us) + 1 if cycle_us > 0 else ready_us
        nbytes = model.param_bytes.get(name, 0)
        if current and (cycle != current_cycle or threshold_bytes <= 0 or size + nbytes > threshold_bytes):
            responses.append((current, current_end, current_delay))
            current, size = [], 0.0
        if not current:
            current_cycle = cycle
            cycle_end_us = cycle * cycle_us if cycle_us > 0 else ready_us
            current_end = min(1.0, cycle_end_us / backward)
            current_delay = negotiation + max(0.0, cycle_end_us - backward)
        current.append(name)
        size += nbytes
    if current:
        responses.append((current, current_end, current_delay))
    return responses


def _horovod_modelled(model: JobModel, whatif: WhatIf) -> bool:
    """A Horovod what-if that models its communication (world size, bandwidth, latency): Horovod fuses the
    tensors into responses at run time, so they are priced as the responses its knobs as run would make, not as
    one collective per tensor (the measured layout; Daydream's baseline keeps one op per tensor by definition)."""
    return whatif.baseline != "daydream" and (
        (whatif.world_size is not None and whatif.world_size != model.world_size) or whatif.bandwidth_gbit is not None
        or whatif.bandwidth_scale != 1.0 or whatif.latency_us is not None)


def _plan_buckets(model: JobModel, whatif: WhatIf, notes: list[str]) -> tuple[list[_Sync], bool]:
    """Bucket layout for the prediction; True when it is the measured one."""
    if model.framework == "horovod" and (whatif.horovod_fusion_mb is not None or whatif.horovod_cycle_ms is not None
                                         or _horovod_modelled(model, whatif)):
        threshold, cycle = model.horovod_knobs or horovod_knobs_as_run([])
        if whatif.horovod_fusion_mb is not None:
            threshold = whatif.horovod_fusion_mb * MB
        if whatif.horovod_cycle_ms is not None:
            cycle = whatif.horovod_cycle_ms * 1000.0
        responses = horovod_fusion(model, threshold, cycle)
        notes.append(f"Horovod fusion at {threshold / MB:g} MB, cycle {cycle / 1000:g} ms: {len(responses)} responses "
                     f"per step (cycles aligned with the start of backward; {model.horovod_negotiation_us:.0f} µs of "
                     "negotiation per cycle)")
        return [_Sync(f"bucket{k}", sum(model.param_bytes[p] for p in group), fraction, None, delay)
                for k, (group, fraction, delay) in enumerate(responses)], False
    if whatif.buckets is None and whatif.bucket_mb is None:
        fractions = model.param_ready_fraction
        return [_Sync(b.key, b.nbytes, max((fractions[p] for p in b.params if p in fractions), default=0.0),
                      b.transmit_us) for b in model.buckets], True
    if not model.param_ready_fraction:
        raise UnanswerableError("re-bucketing needs per-parameter gradient-ready times, which this run lacks")
    order = sorted(model.param_ready_fraction, key=model.param_ready_fraction.get)
    if whatif.buckets is not None:
        groups = whatif.buckets
    else:
        cap = int(whatif.bucket_mb * MB)
        groups = ddp_buckets(order, model.param_bytes, cap)
        notes.append(f"{len(groups)} buckets of up to {whatif.bucket_mb:g} MB, grouped in gradient-ready order "
                     "as DDP's reducer does")
    syncs = []
    for k, group in enumerate(groups):
        missing = [p for p in group if p not in model.param_ready_fraction]
        if missing:
            raise UnanswerableError(f"bucket {k}: unknown parameters {missing[:3]}")
        syncs.append(_Sync(f"bucket{k}", sum(model.param_bytes[p] for p in group),
                           max(model.param_ready_fraction[p] for p in group), None))
    return syncs, False


def _coarsened(model: JobModel, groups: list[list[str]]) -> JobModel:
    """The model with each group's gradient-ready fraction set to the group's latest (one backward graph per
    group: its gradients appear when the graph finishes)."""
    fractions = dict(model.param_ready_fraction)
    for group in groups:
        known = [fractions[p] for p in group if p in fractions]
        if known:
            latest = max(known)
            for p in group:
                if p in fractions:
                    fractions[p] = latest
    return replace(model, param_ready_fraction=fractions)


def _comm_scale(model: JobModel) -> float:
    """Measured / modelled transmission time over all the measured buckets (a ratio of totals, so large buckets
    weigh most): carries what the fit misses (contention, the backend's own overheads) into modelled what-ifs.
    A median of per-bucket ratios let a small bucket that rode the link's idle burst (tbf refills its 256 KB
    bucket during the forward pass) set the rate: the 0.25 MB what-if was 1.7 % faster than with totals.
    Horovod runs: 1 (their model is fitted on Horovod's own calls or its timeline, while the per-tensor records
    close in submission order and overstate them)."""
    if model.framework == "horovod" and model.comm.source.startswith("horovod"):
        return 1.0
    pairs = [(b.transmit_us, model.comm.allreduce_us(b.nbytes, model.world_size)) for b in model.buckets]
    pairs = [(measured, modelled) for measured, modelled in pairs if measured > 0 and modelled > 0]
    return sum(m for m, _ in pairs) / sum(x for _, x in pairs) if pairs else 1.0


COLLAPSE_FROM_RANKS = 64


def synthesize(model: JobModel, whatif: WhatIf, notes: list[str], sample: Optional[MeasuredIteration] = None,
               fold: bool = True, detail: str = "ops") -> ReplayGraph:
    """The replay graph for `whatif`, with the durations of one measured iteration (`sample`) or the medians.

    Symmetry (dPRO's speed-up): a ring whose ranks repeat every m ranks behaves the same at rank r and r + m, so
    only m ranks are built and rank 0 receives from rank m-1 (with identical ranks, m = 1: rank 0 receives its
    own send of the step, which its left neighbour sends at the same moment). The iteration time is the full
    graph's, with m/N of the ops. Used by itself when N synthesised ranks cycle through the m measured ones and
    N is a multiple of m (`fold=False` builds every rank anyway). A model with one template (`representative`)
    is the identical-ranks case: one rank built.

    `detail="ops"`: every compute phase (and backward segment) is expanded into the profiled ops that ran in it
    (`graph/local.py`), scaled to the phase's unprofiled duration; `"coarse"`: one op per phase (dPRO's
    coarsened view, what `coarsen()` makes of the op-level graph; the optimizer's search replays it)."""
    if whatif.op_scale and not any(model.op_profiles.get(r) for r in model.templates):
        raise UnanswerableError("--op-scale needs the profiler's ops, which this run lacks (no kineto_trace.json, "
                                "or run without --no-kineto)")
    templates = sample.templates if sample is not None else model.templates
    if whatif.forward_scale != 1.0 or whatif.backward_scale != 1.0:
        fs, bs = whatif.forward_scale, whatif.backward_scale
        templates = {r: replace(t, forward_us=t.forward_us * fs, backward_us=t.backward_us * bs,
                                backward_segments_us=[x * bs for x in t.backward_segments_us])
                     for r, t in templates.items()}
        notes.append(f"model compute scaled as measured for the variant: forward x{fs:.3f}, backward x{bs:.3f}")
    world = whatif.world_size or model.world_size
    if whatif.ready_groups:
        model = _coarsened(model, whatif.ready_groups)
        notes.append("compiled model: its backward is one graph, so every bucket starts after all of it (no overlap "
                     "of communication with backward)" if len(whatif.ready_groups) == 1 else
                     f"{len(whatif.ready_groups)} compiled blocks: a block's gradients are ready at the end of its "
                     "backward graph (communication still overlaps the other blocks' backward)")
    syncs, measured_layout = _plan_buckets(model, whatif, notes)
    delays = {s.key: s.delay_us for s in syncs if s.delay_us > 0}
    comm = model.comm
    alpha = comm.alpha_us if whatif.latency_us is None else whatif.latency_us
    scale = _comm_scale(model)
    bandwidth = comm.bandwidth_bytes_per_us * whatif.bandwidth_scale
    if whatif.bandwidth_gbit is not None:
        bandwidth = whatif.bandwidth_gbit * 1e3 / 8.0 / max(scale, 1e-9)
    parts = max(1, whatif.partitions)
    use_measured = measured_layout and world == model.world_size and parts == 1 and whatif.latency_us is None \
        and whatif.bandwidth_gbit is None and whatif.bandwidth_scale == 1.0 and not whatif.bucket_partitions
    acc = max(1, whatif.accumulation_steps)
    segments_rc = max(0, whatif.recompute_segments)
    if acc > 1:
        notes.append(f"gradient accumulation over {acc} micro-batches: compute assumed linear in the batch, "
                     "the first micro-batches run without synchronisation, the last one overlaps it")
    if segments_rc:
        notes.append(f"re-computation in {segments_rc} segments: backward repeats {segments_rc - 1}/{segments_rc} "
                     "of the forward")

    steps_per_collective = 2 * max(world - 1, 1)
    step_latency = comm.step_latency_us(world, alpha)
    # a world-size change alone: the collective as measured at the profiled size, plus what the longer ring adds
    # on the network (its messages' latency, its extra bytes at the calibrated bandwidth)
    ring_delta = model.network is not None and world != model.world_size and whatif.latency_us is None \
        and whatif.bandwidth_gbit is None and whatif.bandwidth_scale == 1.0 and whatif.baseline != "daydream"
    if ring_delta:
        notes.append(f"{world} ranks: each collective as measured at {model.world_size} ranks plus the longer "
                     f"ring's messages ({comm.alpha_us:.0f} µs each) and bytes at the calibrated "
                     f"{model.network.bandwidth_bytes_per_us * 8e-3:.3g} Gbit/s")

    def wire_share(n: int) -> float:
        return 2 * (n - 1) / n if n > 1 else 0.0

    def step_parts(nbytes: float) -> tuple[float, float]:
        """(one ring step's duration, the part of it that is latency rather than bytes on the link)."""
        if ring_delta:
            net_bw = model.network.bandwidth_bytes_per_us
            total = scale * comm.allreduce_us(nbytes, model.world_size) \
                + 2 * (world - model.world_size) * alpha \
                + (wire_share(world) - wire_share(model.world_size)) * nbytes / net_bw
            wire = wire_share(world) * nbytes / net_bw
            return total / steps_per_collective, max(0.0, total - wire) / steps_per_collective
        return scale * (step_latency + nbytes / (world * bandwidth)), scale * step_latency

    measured_ranks = sorted(templates)
    period = len(measured_ranks)
    folds = fold and world > period and world % period == 0
    built = period if folds else world  # ranks instantiated in the graph
    if world > len(measured_ranks):
        notes.append(f"{world} ranks synthesised from the {len(measured_ranks)} measured ranks' templates "
                     "(round-robin); compute contention between ranks on one host is not modelled")
    # a step-level ring has 2(N-1) steps on every rank: N^2 ops; beyond COLLAPSE_FROM_RANKS built ranks each
    # collective is one op per rank that starts when the last rank is ready (the ring's steps pipeline behind it)
    collapse = built > COLLAPSE_FROM_RANKS and whatif.baseline != "daydream"
    if collapse:
        notes.append(f"{built} ranks built: each collective replayed as one op per rank that starts when every "
                     f"rank is ready (step-level rings up to {COLLAPSE_FROM_RANKS} ranks: N^2 ops)")
    g = GraphBuilder()
    ins: dict[tuple[int, str, int], int] = {}
    outs: dict[tuple[int, str], int] = {}
    matched: set[str] = set()
    for r in range(built):
        measured_rank = measured_ranks[r % len(measured_ranks)]
        t = templates[measured_rank]
        profile = model.op_profiles.get(measured_rank)
        dev = f"rank{r}.compute"

        def phase_ops(name: str, kind: str, phase: str, duration: float, a: float = 0.0, b: float = 1.0) -> list[int]:
            return _phase_nodes(g, r, dev, name, kind, profile, phase, a, b, duration, whatif, detail, matched)

        chain = []
        if acc > 1:  # the first acc-1 micro-batches: forward + backward without synchronisation
            chain.append(g.op(f"r{r}.microbatches", "FW", r, dev,
                              (acc - 1) / acc * (t.forward_us + t.loss_us + t.backward_us)))
        chain += phase_ops(f"r{r}.forward", "FW", "forward", t.forward_us / acc)
        chain += phase_ops(f"r{r}.loss", "FW", "loss", t.loss_us / acc)
        recompute_us = t.forward_us / acc * (segments_rc - 1) / segments_rc if segments_rc > 1 else 0.0
        if measured_layout and acc == 1 and not recompute_us and not whatif.ready_groups and t.bucket_ready_order \
                and len(t.backward_segments_us) == len(t.bucket_ready_order) + 1:
            order = t.bucket_ready_order
            segments = t.backward_segments_us
            bounds = _measured_cuts(profile, order, segments)
        else:
            order = [s.key for s in sorted(syncs, key=lambda s: s.ready_fraction)]
            compute = max(0.0, t.backward_us - t.enqueue_cost_us * len(model.buckets)) / acc + recompute_us
            bounds = [0.0] + [s.ready_fraction for s in sorted(syncs, key=lambda s: s.ready_fraction)] + [1.0]
            segments = [compute * (b - a) + (t.enqueue_cost_us if k < len(order) else 0.0)
                        for k, (a, b) in enumerate(zip(bounds, bounds[1:]))]
        for k, seg in enumerate(segments):
            chain += phase_ops(f"r{r}.backward.seg{k}", "BW", "backward", seg, bounds[k], bounds[k + 1])
            if k < len(order):
                for p in range(whatif.pieces(order[k])):
                    ins[(r, order[k], p)] = g.op(f"r{r}.In.{order[k]}.p{p}", "VIRTUAL", r, None,
                                                 delays.get(order[k], 0.0))
                    g.edge(chain[-1], ins[(r, order[k], p)])
        finalize = phase_ops(f"r{r}.finalize", "BW", "finalize", t.finalize_us)
        update = phase_ops(f"r{r}.update", "UPDATE", "update", t.update_us)
        tail = phase_ops(f"r{r}.tail", "IO", "tail", t.tail_us)
        g.chain(chain + finalize + update + tail)
        for s in syncs:
            outs[(r, s.key)] = g.op(f"r{r}.Out.{s.key}", "VIRTUAL", r, None, 0.0)
            g.edge(outs[(r, s.key)], finalize[0])
    if whatif.op_scale:
        missing = [p for p in whatif.op_scale if p not in matched]
        notes.append(f"op scale {', '.join(f'{p} x{v:g}' for p, v in whatif.op_scale.items())}: "
                     + (f"no profiled op matches {', '.join(missing)}" if missing else "every pattern matched"))
    for s in syncs:
        parts = whatif.pieces(s.key)
        for p in range(parts):
            piece = s.nbytes / parts
            if whatif.baseline == "daydream":
                for r in range(built):
                    op = g.op(f"r{r}.comm.{s.key}.p{p}", "COMM", r, f"rank{r}.comm", piece / bandwidth,
                              capacity=model.channels)
                    g.edge(ins[(r, s.key, p)], op)
                    g.edge(op, outs[(r, s.key)])
                continue
            if world == 1:
                for r in range(built):
                    g.edge(ins[(r, s.key, p)], outs[(r, s.key)])
                continue
            steps = 2 * (world - 1)
            measured = sample.transmit_us.get(s.key, s.measured_us) if sample is not None else s.measured_us
            modelled = not (use_measured and measured)
            duration, latency = step_parts(piece) if modelled else (measured / steps, 0.0)
            split = modelled and model.channels > 1
            if collapse:  # the whole ring as one op per rank, after every rank's ready point
                join = g.op(f"join.{s.key}.p{p}", "VIRTUAL", 0, None, 0.0)
                for r in range(built):
                    g.edge(ins[(r, s.key, p)], join)
                    op = g.op(f"r{r}.allreduce.{s.key}.p{p}", "COMM", r, f"link{r}->{(r + 1) % world}",
                              duration * steps, capacity=model.channels)
                    g.edge(join, op)
                    g.edge(op, outs[(r, s.key)])
                continue
            previous = {r: [ins[(r, s.key, p)]] for r in range(built)}
            for step in range(steps):
                sends = {}
                for r in range(built):
                    link = f"{r}->{(r + 1) % world}"
                    if split:
                        # a step's latency runs on one of the backend's channels (several collectives can be in
                        # flight), its bytes on the link, which concurrent collectives share
                        lat = g.op(f"r{r}.latency.{s.key}.p{p}.s{step}", "COMM", r, f"channel{link}", latency,
                                   capacity=model.channels)
                        for u in previous[r]:
                            g.edge(u, lat)
                        previous[r] = [lat]
                        sends[r] = g.op(f"r{r}.send.{s.key}.p{p}.s{step}", "COMM", r, f"link{link}",
                                        duration - latency)
                    else:
                        sends[r] = g.op(f"r{r}.send.{s.key}.p{p}.s{step}", "COMM", r, f"link{link}", duration,
                                        capacity=model.channels)
                current = {}
                for r in range(built):
                    left = (r - 1) % built  # built < world: the ring's repeating part (see above)
                    recv = g.op(f"r{r}.recv.{s.key}.p{p}.s{step}", "VIRTUAL", r, None, 0.0)
                    g.edge(sends[left], recv)
                    current[r] = [sends[r], recv]
                for r in range(built):
                    for u in previous[r]:
                        g.edge(u, sends[r])
                previous = current
            for r in range(built):
                for u in previous[r]:
                    g.edge(u, outs[(r, s.key)])
    return g.build({"world_size": world, "buckets": len(syncs), "partitions": whatif.partitions,
                    "ranks_built": built})


def _measured_cuts(profile: Optional[OpProfile], order: list[str], segments: list[float]) -> list[float]:
    """Backward fractions at which the measured buckets' ready points cut the profiled backward: the profiled
    iteration's own cuts (so each segment gets the ops that ran before that bucket's hook) when it saw every
    bucket, else the segments' cumulative shares."""
    cuts = profile.phases["backward"].cuts if profile is not None and "backward" in profile.phases else {}
    if not all(key in cuts for key in order):
        total = sum(segments) or 1.0
        acc = np.cumsum([0.0] + list(segments)) / total
        return [float(x) for x in acc[:-1]] + [1.0]
    bounds = [0.0]
    for key in order:
        bounds.append(max(bounds[-1], cuts[key]))
    return bounds + [1.0]


def _phase_nodes(g: GraphBuilder, rank: int, device: str, name: str, kind: str, profile: Optional[OpProfile],
                 phase: str, a: float, b: float, duration_us: float, whatif: WhatIf, detail: str,
                 matched: set[str]) -> list[int]:
    """One compute phase (or the slice [a, b] of it) of one rank in the replay graph: its profiled ops in order,
    scaled so that they sum to `duration_us` (times any `op_scale` factor), or with `detail="coarse"` one op of
    that total. A phase the profiler did not see is one op."""
    pieces = profile.phases[phase].slice(a, b) if profile is not None and phase in profile.phases else []
    if not pieces:
        return [g.op(name, kind, rank, device, duration_us)]
    factors = [whatif.op_factor(op) for op, _ in pieces] if whatif.op_scale else [1.0] * len(pieces)
    if whatif.op_scale:
        for op, _ in pieces:
            matched.update(p for p in whatif.op_scale if fnmatchcase(op.name, p) or fnmatchcase(op.label, p)
                           or (op.scope and fnmatchcase(op.scope, p)))
    if detail == "coarse":
        return [g.op(name, kind, rank, device, duration_us * sum(s * f for (_, s), f in zip(pieces, factors)))]
    return [g.op(f"{name}:{op.label}", kind, rank, device, duration_us * share * f)
            for (op, share), f in zip(pieces, factors)]


REPLAY_BUDGET_RANK_ITERATIONS = 2048  # per prediction: ranks x replayed iterations, for large runs
MIN_REPLAYED_ITERATIONS = 5


def replayed_samples(model: JobModel, notes: list[str]) -> list:
    """The measured iterations a prediction replays: all of them, or on a large run an even subset (at least 5)
    within REPLAY_BUDGET_RANK_ITERATIONS, said in the notes."""
    samples = model.samples or [None]
    keep = max(MIN_REPLAYED_ITERATIONS, REPLAY_BUDGET_RANK_ITERATIONS // max(1, len(model.templates)))
    if len(samples) <= keep:
        return samples
    chosen = [samples[round(k * (len(samples) - 1) / (keep - 1))] for k in range(keep)]
    notes.append(f"{keep} of the {len(samples)} measured iterations replayed (evenly spaced; a run of "
                 f"{len(model.templates)} measured ranks)")
    return chosen


def predict(model: JobModel, whatif: Optional[WhatIf] = None, detail: str = "ops") -> Prediction:
    """Replay every measured iteration (each with its own durations) and report the median prediction: the
    slowest rank differs from iteration to iteration, which a replay of averaged durations misses."""
    return predict_replayed(model, whatif, detail)[0]


def predict_replayed(model: JobModel, whatif: Optional[WhatIf] = None,
                     detail: str = "ops") -> tuple[Prediction, ReplayGraph, ReplayResult]:
    """`predict`, plus the graph and the replay whose critical path the prediction reports (the median
    iteration's; with an even count of iterations the predicted time averages the middle two): for the
    execution graph and the replayed timeline (engine.execution_graph, engine.replay_chrome_trace)."""
    whatif = whatif or WhatIf()
    notes = list(model.notes)
    samples = replayed_samples(model, notes)
    runs = []
    for sample in samples:
        graph = synthesize(model, whatif, notes if sample is samples[0] else [], sample, detail=detail)
        runs.append((replay(graph), graph))
    times = np.array([result.iteration_time_us for result, _ in runs])
    chosen = int(np.argsort(times)[len(times) // 2])
    result, graph = runs[chosen]
    path = critical_path_report(graph, result)
    measured = np.median([t.measured_iteration_us for t in model.templates.values()]) / 1000
    notes.append(_detail_note(model, detail))
    if whatif.is_identity():
        notes.append("the job as it ran: measured buckets and transmission times, profiled iterations without "
                     "torch.profiler")
    elif model.transport and model.transport["shares_cores"] and whatif.changes_communication():
        t = model.transport
        beside = [row for row in t.get("allreduce_idle_vs_beside_compute_us") or [] if row[0] == 1 << 20]
        slowed = (f"; a 1 MiB all-reduce took {beside[0][2] / 1000:.1f} ms beside compute vs "
                  f"{beside[0][1] / 1000:.1f} ms idle") if beside else ""
        notes.append(f"caution: the transport runs on the cores the ranks compute on ({t['cores_per_rank']:g} "
                     f"core(s) per rank, {t['compute_threads']} compute thread(s); its all-reduces kept it busy "
                     f"{100 * t['transport_cpu_share']:.0f} % of their time{slowed}), while the replay gives "
                     "communication devices of its own: more collectives cost more and overlap gains less than "
                     "predicted here")
    if graph.meta["ranks_built"] < graph.meta["world_size"]:
        built = graph.meta["ranks_built"]
        notes.append(f"the ring of {graph.meta['world_size']} ranks repeats every {built} ranks (they cycle "
                     f"through the measured ones): {built} built, exactly equivalent; "
                     "utilisation and critical path are shown for those")
    if len(runs) > 1:
        notes.append(f"median of {len(runs)} replays, one per measured iteration (p10-p90 "
                     f"{np.percentile(times, 10) / 1000:.2f}-{np.percentile(times, 90) / 1000:.2f} ms)")
    utilisation = result.device_utilisation()
    check = self_check(model, times) if whatif.is_identity() and whatif.baseline != "daydream" else None
    if check is not None and check["status"] != "agrees":
        notes.append(check["message"])
    return (Prediction(
        predicted_iteration_time_ms=round(float(np.median(times)) / 1000, 4),
        world_size=graph.meta["world_size"], buckets=graph.meta["buckets"], baseline=whatif.baseline,
        measured_iteration_time_ms=round(float(measured), 4) if whatif.is_identity() else None,
        critical_path={k: v for k, v in path.items() if k != "path"},
        device_utilisation={k: round(v, 4) for k, v in sorted(utilisation.items())[:64]},
        comm_model=dict(model.comm.to_json(), transport=model.transport), replay_ops=graph.size,
        replay_time_s=round(sum(r.replay_time_s for r, _ in runs), 4),
        engine=result.engine, whatif={k: v for k, v in asdict(whatif).items() if k != "buckets"}, notes=notes,
        spread_ms=[round(float(np.percentile(times, 10)) / 1000, 4), round(float(np.percentile(times, 90)) / 1000, 4)],
        self_check=check),
        graph, result)


def _detail_note(model: JobModel, detail: str) -> str:
    """What the compute nodes of the replayed graph are."""
    if not model.op_profiles:
        return "compute replayed as phases (no profiler ops in this run)"
    counts = sorted(p.op_count for p in model.op_profiles.values())
    scaled = ", ".join(f"{phase} x{ratio:.2f}" for phase, ratio in model.op_scaling.items()
                       if phase in ("forward", "backward", "update"))
    if detail == "coarse":
        return f"compute replayed as phases (the coarsened view of {counts[len(counts) // 2]} profiled ops per rank)"
    return (f"op level: {counts[len(counts) // 2]} profiled ops per rank (median), scaled phase by phase to the "
            f"iterations without the profiler ({scaled})")


def replay_once(model: JobModel, whatif: WhatIf, detail: str = "coarse") -> tuple[float, dict]:
    """One replay of the median durations (the optimizer's fast evaluation, on the coarsened view by default):
    iteration time in µs and the critical-path report."""
    graph = synthesize(model, whatif, [], detail=detail)
    result = replay(graph)
    return result.iteration_time_us, critical_path_report(graph, result)


def representative(model: JobModel) -> JobModel:
    """The model with every rank alike: the measured rank with the longest iteration stands for all (a
    synchronous job runs at its slowest rank's pace): its replay builds a single rank (see `synthesize`)."""
    slowest = max(model.templates, key=lambda r: model.templates[r].measured_iteration_us)
    return replace(model, templates={slowest: model.templates[slowest]}, samples=[])


def sync_time_us(model: JobModel, nbytes: int, world: Optional[int] = None, partitions: int = 1) -> float:
    """Partial replay: the time to synchronise one tensor of `nbytes` over `world` ranks split into
    `partitions` pieces, with nothing else in the graph (the optimizer's t_sync(s, k)). Every rank is alike
    here, so only rank 0 is built and each step receives what rank 0 itself sends (see `synthesize`)."""
    world = world or model.world_size
    if world <= 1:
        return 0.0
    g = GraphBuilder()
    scale = _comm_scale(model)
    latency = scale * model.comm.step_latency_us(world)
    wire = scale * nbytes / partitions / (world * model.comm.bandwidth_bytes_per_us)
    if model.channels == 1:  # one collective at a time: latency and bytes on the link, in order
        wire, latency = wire + latency, 0.0
    start = g.op("r0.In", "VIRTUAL", 0, None, 0.0)
    end = g.op("r0.Out", "VIRTUAL", 0, None, 0.0)
    for p in range(partitions):
        previous = [start]
        for s in range(2 * (world - 1)):
            lat = g.op(f"r0.latency.p{p}.s{s}", "COMM", 0, "channel0", latency, capacity=model.channels)
            for u in previous:
                g.edge(u, lat)
            send = g.op(f"r0.send.p{p}.s{s}", "COMM", 0, "link0", wire)
            g.edge(lat, send)
            recv = g.op(f"r0.recv.p{p}.s{s}", "VIRTUAL", 0, None, 0.0)
            g.edge(send, recv)  # what the left neighbour sends in this step, at the same moment
            previous = [send, recv]
        for u in previous:
            g.edge(u, end)
    return replay(g.build(), use_fast=False).iteration_time_us


def predict_run(run, whatif: Optional[WhatIf] = None) -> Prediction:
    return predict(build_job_model(run), whatif)
