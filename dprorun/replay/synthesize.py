"""The global DFG that is replayed: local DFGs of every rank joined by the communication topology.

`synthesize(model, whatif)` builds the measured ranks' local DFGs and answers the question with passes on them,
each one function `ReplayGraph -> ReplayGraph`:
  1. the measured iteration's per-rank phase durations (one sample's, or the medians) and the bucket plan
     (`whatif.plan_syncs`: the measured layout, re-bucketing, Horovod's fusion, TF's packs, compiled regions);
  2. `local_dfg` per measured rank (replay/local_dfg.py): forward -> loss -> backward -> finalize -> update ->
     tail, each phase the profiled ops that ran in it (graph/local.py) scaled to the phase; the backward cut as
     measured (an In node where each measured bucket's hook ran), or uncut for any other bucket plan; a
     communication plan (`replay/comm.CommPlan`) names the In and Out nodes;
  3. `fusion.partition` (the measured buckets in pieces) or `fusion.set_buckets` (the uncut backward cut at the
     plan's ready points, In nodes per piece, DDP's enqueue cost after each cut);
  4. `passes.recompute` (a re-computed forward after each backward segment), `passes.accumulate` (the
     micro-batches before the synchronised one);
  5. `comm.set_world_size`: the local DFGs copied to the ranks the question's world builds (round-robin, folded
     where the ring repeats);
  6. `comm.set_network`: the ranks joined by the topology (a step-level ring, the collapsed ring beyond
     COLLAPSE_FROM_RANKS built ranks, or Daydream's baseline) priced by `CommPricing` for the question's bandwidth
     and latency (measured transmissions for the job as it ran, else the fitted cost model scaled to them);
  7. `compute_passes`: a measured variant's forward/backward scale, the per-op scale (replay/passes.py).

Modelled steps of a backend with several channels (gloo) are split in two: the step latency on one of the
backend's channels (`channel r->r+1`, as many slots as collectives in flight), the bytes on the link, which
concurrent collectives share (one slot). Symmetry (dPRO's speed-up): a ring whose ranks repeat every m ranks
behaves the same at rank r and r + m, so only m ranks are built and rank 0 receives from rank m-1 (exact).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

from dprorun.fsutil import UnanswerableError
from dprorun.replay.comm import CommPlan, set_network, set_world_size
from dprorun.replay.engine import GraphBuilder, ReplayGraph
from dprorun.replay.fusion import partition, set_buckets
from dprorun.replay.local_dfg import as_measured, local_dfg
from dprorun.replay.passes import accumulate, recompute, scale_compute, scale_ops
from dprorun.replay.template import JobModel, MeasuredIteration
from dprorun.replay.whatif import FSDP_RESTRUCTURED, WhatIf, plan_syncs, with_ready_groups

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
    measured = as_measured(templates, whatif, measured_layout)  # the backward as measured, or uncut
    if model.blocking_collectives and (not measured or whatif.partitions > 1 or whatif.bucket_partitions):
        raise UnanswerableError(FSDP_RESTRUCTURED)
    g = GraphBuilder()
    ends = [local_dfg(g, r, templates[rank], model.op_profiles.get(rank), model, syncs, measured, detail)
            for r, rank in enumerate(measured_ranks)]
    period = len(measured_ranks)
    built_syncs = _synchronised_in(syncs, ends) if measured else []
    plan = CommPlan(model, replace(whatif, partitions=1, bucket_partitions={}), built_syncs, measured_layout, sample,
                    ins={(s.key, 0): [e.ins[(s.key, 0)] for e in ends] for s in built_syncs},
                    outs={s.key: [e.outs[s.key] for e in ends] for s in built_syncs}, world=period, collapse=False,
                    local_nodes=g.size, enqueue_us=[templates[rank].enqueue_cost_us for rank in measured_ranks])
    local = g.build({"world_size": period, "buckets": len(built_syncs), "partitions": 1, "ranks_built": period,
                     "comm_plan": plan, "detail": detail, "backward_layout": "measured" if measured else "model"})
    # the collectives: the measured ones split into pieces, or the question's bucket plan cutting the uncut
    # backward (replay/fusion.py)
    if measured:
        local = partition(local, whatif.partitions, whatif.bucket_partitions)
    else:
        local = set_buckets(local, syncs, whatif.partitions, whatif.bucket_partitions, measured=measured_layout)
    # re-computation and accumulation: passes on the measured ranks' local DFGs (replay/passes.py); then the
    # world-size pass copies them to the ranks the question's world builds (replay/comm.py)
    local = accumulate(recompute(local, whatif.recompute_segments), whatif.accumulation_steps)
    local = set_world_size(local, world, fold, notes)
    # the ranks joined by the communication topology, priced for the question's network (the network pass)
    graph = set_network(local, whatif.bandwidth_gbit, whatif.bandwidth_scale, whatif.latency_us, notes)
    return compute_passes(graph, whatif, notes)


def _synchronised_in(syncs: list, ends: list) -> list:
    """The measured buckets a replayed iteration handed over on every rank: one of a step whose calls vary (layers
    skipped at random, their gradients None, all-reduced by hand only where they exist) lacks some of the model's
    buckets, which its replay has no ready point for (it failed: KeyError); it is replayed without them, as it ran."""
    return [s for s in syncs if all((s.key, 0) in e.ins for e in ends)]


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


def _structure_notes(whatif: WhatIf, notes: list[str]) -> None:
    acc, segments = max(1, whatif.accumulation_steps), max(0, whatif.recompute_segments)
    if acc > 1:
        notes.append(f"gradient accumulation over {acc} micro-batches: compute assumed linear in the batch, "
                     "the first micro-batches run without synchronisation, the last one overlaps it")
    if segments:
        notes.append(f"re-computation in {segments} segments: backward repeats {segments - 1}/{segments} "
                     "of the forward")
