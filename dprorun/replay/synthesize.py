"""The global DFG that is replayed: local DFGs of every rank joined by the communication topology.

`synthesize(model, whatif)` builds it in steps, each a function or a pass on the graph:
  1. the measured iteration's per-rank phase durations (one sample's, or the medians);
  2. the bucket plan (`whatif.plan_syncs`): which collectives there are, when each becomes ready (measured
     layout, re-bucketing, Horovod's fusion, compiled regions, partitions);
  3. `local_dfg` per measured rank: the compute chain forward -> loss -> backward segments (an In node after the segment
     in which each bucket's last gradient became ready) -> finalize (after every Out node) -> update -> tail;
     at op level every phase is the profiled ops that ran in it (graph/local.py), scaled to the phase; then the
     structural passes on these local DFGs (replay/passes.py): `recompute` (a re-computed forward after each
     backward segment) and `accumulate` (the micro-batches before the synchronised one);
  4. the communication plan (`replay/comm.CommPlan`: each collective's In nodes per piece and Out nodes on every
     built rank); the world-size pass `replay/comm.set_world_size` copies the measured ranks' local DFGs to the
     ranks the question's world builds (round-robin, folded where the ring repeats); then the network pass `replay/comm.set_network`, which joins them by the topology (a step-level
     ring, the collapsed ring beyond COLLAPSE_FROM_RANKS built ranks, or Daydream's baseline) priced by
     `CommPricing` for the question's bandwidth and latency (measured transmissions for the job as it ran, else
     the fitted cost model scaled to them); on a built graph the same pass answers another network;
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
from dprorun.replay.comm import CommPlan, set_network, set_world_size
from dprorun.replay.engine import GraphBuilder, ReplayGraph
from dprorun.replay.passes import accumulate, recompute, scale_compute, scale_ops
from dprorun.replay.template import JobModel, MeasuredIteration, RankTemplate
from dprorun.replay.whatif import Sync, WhatIf, plan_syncs, with_ready_groups

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
    _structure_notes(whatif, notes)
    measured_ranks = sorted(templates)
    g = GraphBuilder()
    ends = [local_dfg(g, r, templates[measured], model.op_profiles.get(measured), model, whatif, syncs,
                      measured_layout, detail) for r, measured in enumerate(measured_ranks)]
    period = len(measured_ranks)
    plan = CommPlan(model, whatif, syncs, measured_layout, sample,
                    ins={(s.key, p): [e.ins[(s.key, p)] for e in ends] for s in syncs
                         for p in range(whatif.pieces(s.key))},
                    outs={s.key: [e.outs[s.key] for e in ends] for s in syncs}, world=period, collapse=False,
                    local_nodes=g.size)
    local = g.build({"world_size": period, "buckets": len(syncs), "partitions": whatif.partitions,
                     "ranks_built": period, "comm_plan": plan})
    # re-computation and accumulation: passes on the measured ranks' local DFGs (replay/passes.py); then the
    # world-size pass copies them to the ranks the question's world builds (replay/comm.py)
    local = accumulate(recompute(local, whatif.recompute_segments), whatif.accumulation_steps)
    local = set_world_size(local, world, fold, notes)
    # the ranks joined by the communication topology, priced for the question's network (the network pass)
    graph = set_network(local, whatif.bandwidth_gbit, whatif.bandwidth_scale, whatif.latency_us, notes)
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


def restructured(whatif: WhatIf) -> bool:
    """Re-computation and accumulation are passes on a backward laid out by the model (cut at the collectives'
    ready points, DDP's enqueue cost apart), not on the measured segments (which include that cost)."""
    return whatif.accumulation_steps > 1 or whatif.recompute_segments > 1


def _structure_notes(whatif: WhatIf, notes: list[str]) -> None:
    acc, segments = max(1, whatif.accumulation_steps), max(0, whatif.recompute_segments)
    if acc > 1:
        notes.append(f"gradient accumulation over {acc} micro-batches: compute assumed linear in the batch, "
                     "the first micro-batches run without synchronisation, the last one overlaps it")
    if segments:
        notes.append(f"re-computation in {segments} segments: backward repeats {segments - 1}/{segments} "
                     "of the forward")


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

    chain = phase(f"r{r}.forward", "FW", "forward", t.forward_us)
    chain += phase(f"r{r}.loss", "FW", "loss", t.loss_us)
    if measured_layout and not restructured(whatif) and not whatif.ready_groups and t.bucket_ready_order \
            and len(t.backward_segments_us) == len(t.bucket_ready_order) + 1:
        order, segments = t.bucket_ready_order, t.backward_segments_us  # measured: enqueue cost included
        bounds = measured_cuts(profile, order, segments)
        enqueue_us = 0.0
    else:
        ordered = sorted(syncs, key=lambda s: s.ready_fraction)
        order = [s.key for s in ordered]
        compute = max(0.0, t.backward_us - t.enqueue_cost_us * len(model.buckets))
        bounds = [0.0] + [s.ready_fraction for s in ordered] + [1.0]
        segments = [compute * (b - a) for a, b in zip(bounds, bounds[1:])]
        enqueue_us = t.enqueue_cost_us
    delays = {s.key: s.delay_us for s in syncs if s.delay_us > 0}
    ins: dict[tuple[str, int], int] = {}
    for k, seg in enumerate(segments):
        chain += phase(f"r{r}.backward.seg{k}", "BW", "backward", seg, bounds[k], bounds[k + 1])
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
