"""The global DFG that is replayed: local DFGs of every rank joined by the communication topology.

`synthesize(model, whatif)` builds it in steps, each a function:
  1. the measured iteration's per-rank phase durations (one sample's, or the medians);
  2. the bucket plan (`whatif.plan_syncs`): which collectives there are, when each becomes ready (measured
     layout, re-bucketing, Horovod's fusion, compiled regions, partitions);
  3. `local_dfg` per rank: the compute chain forward -> loss -> backward segments (an In node after the segment
     in which each bucket's last gradient became ready) -> finalize (after every Out node) -> update -> tail;
     at op level every phase is the profiled ops that ran in it (graph/local.py), scaled to the phase;
  4. per collective and piece the topology that joins the ranks' In and Out nodes: a step-level ring
     (`ring_allreduce`: 2(N-1) steps; each rank's SEND on its outgoing link, the receiver's RECV joining it),
     the collapsed ring beyond COLLAPSE_FROM_RANKS built ranks (`collapsed_allreduce`), or Daydream's baseline
     (`daydream_sync`: bytes / bandwidth on the rank's own device, no cross-rank edge); each priced by
     `CommPricing` (measured transmissions for the job as it ran, else the fitted cost model scaled to them);
  5. `compute_passes`: the compute what-ifs as passes on the built graph (replay/passes.py): a measured variant's
     forward/backward scale, the per-op scale.

Modelled steps of a backend with several channels (gloo) are split in two: the step latency on one of the
backend's channels (`channel r->r+1`, as many slots as collectives in flight), the bytes on the link, which
concurrent collectives share (one slot). Symmetry (dPRO's speed-up): a ring whose ranks repeat every m ranks
behaves the same at rank r and r + m, so only m ranks are built and rank 0 receives from rank m-1 (exact).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from dprorun.graph.local import OpProfile
from dprorun.replay.engine import GraphBuilder, ReplayGraph
from dprorun.replay.passes import scale_compute, scale_ops
from dprorun.replay.template import JobModel, MeasuredIteration, RankTemplate
from dprorun.replay.whatif import Sync, WhatIf, comm_scale, plan_syncs, with_ready_groups

COLLAPSE_FROM_RANKS = 64


def synthesize(model: JobModel, whatif: WhatIf, notes: list[str], sample: Optional[MeasuredIteration] = None,
               fold: bool = True, detail: str = "ops") -> ReplayGraph:
    """The replay graph for `whatif`, with the durations of one measured iteration (`sample`) or the medians.

    `detail="ops"`: every compute phase (and backward segment) is the profiled ops that ran in it; `"coarse"`:
    one op per phase (dPRO's coarsened view, what `coarsen()` makes of the op-level graph; the optimizer's
    search replays it). `fold=False` builds every rank even where the ring repeats (see the module doc); a
    model with one template (`representative`) is the identical-ranks case: one rank built."""
    templates = sample.templates if sample is not None else model.templates
    world = whatif.world_size or model.world_size
    model = with_ready_groups(model, whatif, notes)
    syncs, measured_layout = plan_syncs(model, whatif, notes)
    pricing = CommPricing.for_whatif(model, whatif, world, measured_layout, notes)
    _compute_notes(whatif, notes)
    measured_ranks = sorted(templates)
    period = len(measured_ranks)
    built = period if fold and world > period and world % period == 0 else world
    if world > period:
        notes.append(f"{world} ranks synthesised from the {period} measured ranks' templates "
                     "(round-robin); compute contention between ranks on one host is not modelled")
    collapse = built > COLLAPSE_FROM_RANKS and whatif.baseline != "daydream"
    if collapse:
        notes.append(f"{built} ranks built: each collective replayed as one op per rank that starts when every "
                     f"rank is ready (step-level rings up to {COLLAPSE_FROM_RANKS} ranks: N^2 ops)")
    g = GraphBuilder()
    ends: list[RankEnds] = []
    for r in range(built):
        measured_rank = measured_ranks[r % period]
        ends.append(local_dfg(g, r, templates[measured_rank], model.op_profiles.get(measured_rank), model, whatif,
                              syncs, measured_layout, detail))
    for s in syncs:
        for p in range(whatif.pieces(s.key)):
            ins = [e.ins[(s.key, p)] for e in ends]
            outs = [e.outs[s.key] for e in ends]
            if whatif.baseline == "daydream":
                daydream_sync(g, s, p, whatif.pieces(s.key), ins, outs, pricing, model.channels)
            elif world == 1:
                for u, v in zip(ins, outs):
                    g.edge(u, v)
            else:
                duration, latency = pricing.step(s, whatif.pieces(s.key), sample)
                topology = collapsed_allreduce if collapse else ring_allreduce
                topology(g, f"{s.key}.p{p}", ins, outs, world, duration, latency, model.channels,
                         split=pricing.split(s, sample))
    graph = g.build({"world_size": world, "buckets": len(syncs), "partitions": whatif.partitions,
                     "ranks_built": built})
    return compute_passes(graph, whatif, notes)


def compute_passes(graph: ReplayGraph, whatif: WhatIf, notes: list[str]) -> ReplayGraph:
    """The compute what-ifs as passes on the built graph (replay/passes.py): a measured variant's forward and
    backward scale, then the per-op scale."""
    fs, bs = whatif.forward_scale, whatif.backward_scale
    if fs != 1.0 or bs != 1.0:
        notes.append(f"model compute scaled as measured for the variant: forward x{fs:.3f}, backward x{bs:.3f}")
        graph = scale_compute(graph, fs, bs)
    if whatif.op_scale:
        graph, matched = scale_ops(graph, whatif.op_scale)
        missing = [p for p in whatif.op_scale if p not in matched]
        notes.append(f"op scale {', '.join(f'{p} x{v:g}' for p, v in whatif.op_scale.items())}: "
                     + (f"no profiled op matches {', '.join(missing)}" if missing else "every pattern matched"))
    return graph


def _compute_notes(whatif: WhatIf, notes: list[str]) -> None:
    acc, segments = max(1, whatif.accumulation_steps), max(0, whatif.recompute_segments)
    if acc > 1:
        notes.append(f"gradient accumulation over {acc} micro-batches: compute assumed linear in the batch, "
                     "the first micro-batches run without synchronisation, the last one overlaps it")
    if segments:
        notes.append(f"re-computation in {segments} segments: backward repeats {segments - 1}/{segments} "
                     "of the forward")


@dataclass
class CommPricing:
    """How long one ring step of a collective takes: measured (the job as it ran: each bucket's measured
    transmission spread over its steps) or modelled (the cost model scaled to the measured transmissions; a
    world-size change alone adds the longer ring's messages and bytes to the collective as measured)."""

    model: JobModel
    world: int
    use_measured: bool
    ring_delta: bool
    scale: float
    bandwidth: float  # bytes/µs
    alpha_us: float

    @classmethod
    def for_whatif(cls, model: JobModel, whatif: WhatIf, world: int, measured_layout: bool,
                   notes: list[str]) -> "CommPricing":
        comm = model.comm
        scale = comm_scale(model)
        bandwidth = comm.bandwidth_bytes_per_us * whatif.bandwidth_scale
        if whatif.bandwidth_gbit is not None:
            bandwidth = whatif.bandwidth_gbit * 1e3 / 8.0 / max(scale, 1e-9)
        network_same = whatif.latency_us is None and whatif.bandwidth_gbit is None and whatif.bandwidth_scale == 1.0
        use_measured = measured_layout and world == model.world_size and max(1, whatif.partitions) == 1 \
            and network_same and not whatif.bucket_partitions
        ring_delta = model.network is not None and world != model.world_size and network_same \
            and whatif.baseline != "daydream"
        if ring_delta:
            notes.append(f"{world} ranks: each collective as measured at {model.world_size} ranks plus the longer "
                         f"ring's messages ({comm.alpha_us:.0f} µs each) and bytes at the calibrated "
                         f"{model.network.bandwidth_bytes_per_us * 8e-3:.3g} Gbit/s")
        alpha = comm.alpha_us if whatif.latency_us is None else whatif.latency_us
        return cls(model, world, use_measured, ring_delta, scale, bandwidth, alpha)

    def measured_us(self, sync: Sync, sample: Optional[MeasuredIteration]) -> Optional[float]:
        measured = sample.transmit_us.get(sync.key, sync.measured_us) if sample is not None else sync.measured_us
        return measured if self.use_measured and measured else None

    def split(self, sync: Sync, sample: Optional[MeasuredIteration]) -> bool:
        """Modelled steps of a backend with several channels: latency on a channel, bytes on the link."""
        return self.measured_us(sync, sample) is None and self.model.channels > 1

    def step(self, sync: Sync, pieces: int, sample: Optional[MeasuredIteration]) -> tuple[float, float]:
        """(one ring step's duration, the part of it that is latency rather than bytes on the link)."""
        steps = 2 * max(self.world - 1, 1)
        measured = self.measured_us(sync, sample)
        if measured is not None:
            return measured / steps, 0.0
        nbytes = sync.nbytes / pieces
        model, comm = self.model, self.model.comm
        if self.ring_delta:
            net_bw = model.network.bandwidth_bytes_per_us
            total = self.scale * comm.allreduce_us(nbytes, model.world_size) \
                + 2 * (self.world - model.world_size) * comm.alpha_us \
                + (_wire_share(self.world) - _wire_share(model.world_size)) * nbytes / net_bw
            wire = _wire_share(self.world) * nbytes / net_bw
            return total / steps, max(0.0, total - wire) / steps
        latency = comm.step_latency_us(self.world, self.alpha_us)
        return self.scale * (latency + nbytes / (self.world * self.bandwidth)), self.scale * latency


def _wire_share(n: int) -> float:
    return 2 * (n - 1) / n if n > 1 else 0.0


@dataclass
class RankEnds:
    """Where a rank's local DFG meets the communication topology: In node per (bucket, piece), Out per bucket."""

    ins: dict[tuple[str, int], int]
    outs: dict[str, int]


def local_dfg(g: GraphBuilder, r: int, t: RankTemplate, profile: Optional[OpProfile], model: JobModel,
              whatif: WhatIf, syncs: list[Sync], measured_layout: bool, detail: str) -> RankEnds:
    """One rank's compute chain with its In and Out nodes (see the module doc). Every compute node carries its
    phase, and the profiled ops it is made of, for the compute passes."""
    dev = f"rank{r}.compute"

    def phase(name: str, kind: str, which: str, duration: float, a: float = 0.0, b: float = 1.0) -> list[int]:
        return phase_nodes(g, r, dev, name, kind, profile, which, a, b, duration, detail)

    acc = max(1, whatif.accumulation_steps)
    segments_rc = max(0, whatif.recompute_segments)
    chain = []
    if acc > 1:  # the first acc-1 micro-batches: forward + backward without synchronisation
        for which, kind, us in (("forward", "FW", t.forward_us), ("loss", "FW", t.loss_us),
                                ("backward", "BW", t.backward_us)):
            chain.append(g.op(f"r{r}.microbatches.{which}", kind, r, dev, (acc - 1) / acc * us, phase=which))
    chain += phase(f"r{r}.forward", "FW", "forward", t.forward_us / acc)
    chain += phase(f"r{r}.loss", "FW", "loss", t.loss_us / acc)
    recompute_us = t.forward_us / acc * (segments_rc - 1) / segments_rc if segments_rc > 1 else 0.0
    if measured_layout and acc == 1 and not recompute_us and not whatif.ready_groups and t.bucket_ready_order \
            and len(t.backward_segments_us) == len(t.bucket_ready_order) + 1:
        order, segments = t.bucket_ready_order, t.backward_segments_us  # measured: enqueue cost included
        bounds = measured_cuts(profile, order, segments)
        enqueue_us = 0.0
    else:
        ordered = sorted(syncs, key=lambda s: s.ready_fraction)
        order = [s.key for s in ordered]
        compute = max(0.0, t.backward_us - t.enqueue_cost_us * len(model.buckets)) / acc
        bounds = [0.0] + [s.ready_fraction for s in ordered] + [1.0]
        segments = [compute * (b - a) for a, b in zip(bounds, bounds[1:])]
        enqueue_us = t.enqueue_cost_us
    delays = {s.key: s.delay_us for s in syncs if s.delay_us > 0}
    ins: dict[tuple[str, int], int] = {}
    for k, seg in enumerate(segments):
        chain += phase(f"r{r}.backward.seg{k}", "BW", "backward", seg, bounds[k], bounds[k + 1])
        if recompute_us:  # the segment's share of the re-computed forward
            chain.append(g.op(f"r{r}.backward.seg{k}.recompute", "BW", r, dev,
                              recompute_us * (bounds[k + 1] - bounds[k]), phase="recompute"))
        if k < len(order) and enqueue_us:  # DDP's hook handing the bucket over (measured, not model compute)
            chain.append(g.op(f"r{r}.backward.seg{k}.enqueue", "BW", r, dev, enqueue_us, phase="enqueue"))
        if k < len(order):
            for p in range(whatif.pieces(order[k])):
                ins[(order[k], p)] = g.op(f"r{r}.In.{order[k]}.p{p}", "VIRTUAL", r, None, delays.get(order[k], 0.0))
                g.edge(chain[-1], ins[(order[k], p)])
    finalize = phase(f"r{r}.finalize", "BW", "finalize", t.finalize_us)
    g.chain(chain + finalize + phase(f"r{r}.update", "UPDATE", "update", t.update_us)
            + phase(f"r{r}.tail", "IO", "tail", t.tail_us))
    outs = {}
    for s in syncs:
        outs[s.key] = g.op(f"r{r}.Out.{s.key}", "VIRTUAL", r, None, 0.0)
        g.edge(outs[s.key], finalize[0])
    return RankEnds(ins, outs)


def measured_cuts(profile: Optional[OpProfile], order: list[str], segments: list[float]) -> list[float]:
    """Backward fractions at which the measured buckets' ready points cut the profiled backward: the profiled
    iteration's own cuts (so each segment gets the ops that ran before that bucket's hook) when it saw every
    bucket, else the segments' cumulative shares."""
    cuts = profile.phases["backward"].cuts if profile is not None and "backward" in profile.phases else {}
    if not all(key in cuts for key in order):
        total = sum(segments) or 1.0
        cumulative = np.cumsum([0.0] + list(segments)) / total
        return [float(x) for x in cumulative[:-1]] + [1.0]
    bounds = [0.0]
    for key in order:
        bounds.append(max(bounds[-1], cuts[key]))
    return bounds + [1.0]


def phase_nodes(g: GraphBuilder, rank: int, device: str, name: str, kind: str, profile: Optional[OpProfile],
                phase: str, a: float, b: float, duration_us: float, detail: str) -> list[int]:
    """One compute phase (or the slice [a, b] of it) of one rank: its profiled ops in order, scaled so that they
    sum to `duration_us`, or with `detail="coarse"` one op of that total (made of those ops, by share). A phase
    the profiler did not see is one op."""
    pieces = profile.phases[phase].slice(a, b) if profile is not None and phase in profile.phases else []
    if not pieces:
        return [g.op(name, kind, rank, device, duration_us, phase=phase)]
    if detail == "coarse":
        total = sum(share for _, share in pieces) or 1.0
        return [g.op(name, kind, rank, device, duration_us * total, phase=phase,
                     parts=tuple((op, share / total) for op, share in pieces))]
    return [g.op(f"{name}:{op.label}", kind, rank, device, duration_us * share, phase=phase, parts=((op, 1.0),))
            for op, share in pieces]


def ring_allreduce(g: GraphBuilder, key: str, ins: list[int], outs: list[int], world: int, duration: float,
                   latency: float, channels: int, split: bool) -> None:
    """A step-level ring of 2(N-1) steps between the built ranks' In and Out nodes: at each step every rank's
    SEND occupies its outgoing link and the right neighbour's RECV (no device) joins it; the next step needs
    both the rank's own SEND and RECV. Built < world: the ring's repeating part, rank 0 receiving from the last
    built rank."""
    built = len(ins)
    previous = {r: [ins[r]] for r in range(built)}
    for step in range(2 * (world - 1)):
        sends = {}
        for r in range(built):
            link = f"{r}->{(r + 1) % world}"
            if split:
                lat = g.op(f"r{r}.latency.{key}.s{step}", "COMM", r, f"channel{link}", latency, capacity=channels)
                for u in previous[r]:
                    g.edge(u, lat)
                previous[r] = [lat]
                sends[r] = g.op(f"r{r}.send.{key}.s{step}", "COMM", r, f"link{link}", duration - latency)
            else:
                sends[r] = g.op(f"r{r}.send.{key}.s{step}", "COMM", r, f"link{link}", duration, capacity=channels)
        current = {}
        for r in range(built):
            recv = g.op(f"r{r}.recv.{key}.s{step}", "VIRTUAL", r, None, 0.0)
            g.edge(sends[(r - 1) % built], recv)
            current[r] = [sends[r], recv]
        for r in range(built):
            for u in previous[r]:
                g.edge(u, sends[r])
        previous = current
    for r in range(built):
        for u in previous[r]:
            g.edge(u, outs[r])


def collapsed_allreduce(g: GraphBuilder, key: str, ins: list[int], outs: list[int], world: int, duration: float,
                        latency: float, channels: int, split: bool) -> None:
    """The whole ring as one op per rank, after every rank's ready point (large rings: N ops, not N^2)."""
    join = g.op(f"join.{key}", "VIRTUAL", 0, None, 0.0)
    for r, (u, v) in enumerate(zip(ins, outs)):
        g.edge(u, join)
        op = g.op(f"r{r}.allreduce.{key}", "COMM", r, f"link{r}->{(r + 1) % world}", duration * 2 * (world - 1),
                  capacity=channels)
        g.edge(join, op)
        g.edge(op, v)


def daydream_sync(g: GraphBuilder, sync: Sync, piece: int, pieces: int, ins: list[int], outs: list[int],
                  pricing: CommPricing, channels: int) -> None:
    """Daydream's baseline: bytes / bandwidth on the rank's own comm device, no cross-rank dependency."""
    for r, (u, v) in enumerate(zip(ins, outs)):
        op = g.op(f"r{r}.comm.{sync.key}.p{piece}", "COMM", r, f"rank{r}.comm",
                  sync.nbytes / pieces / pricing.bandwidth, capacity=channels)
        g.edge(u, op)
        g.edge(op, v)
