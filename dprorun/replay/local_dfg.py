"""One rank's local DFG, as `synthesize` lays it out: the compute chain forward -> loss -> backward -> finalize
-> update -> tail, each phase the profiled ops that ran in it (graph/local.py) scaled to the phase's measured
duration (or one op per phase: the coarsened view), with an In node per collective piece where the backward
hands a collective over and an Out node per collective before finalize.

The backward is laid out as it was measured (`measured_cuts`: cut where each measured bucket's hook ran, the
measured segments' durations, DDP's enqueue cost inside them) for the job's own buckets, or uncut (one
segment: the model's backward compute, DDP's enqueue cost apart), which the tensor-fusion pass
(replay/fusion.set_buckets) cuts at the ready points of the buckets a question asks for.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from dprorun.graph.local import OpProfile
from dprorun.replay.engine import GraphBuilder
from dprorun.replay.template import JobModel, RankTemplate
from dprorun.replay.whatif import Sync, WhatIf


@dataclass
class RankEnds:
    """Where a rank's local DFG meets the communication topology: In node per (bucket, piece), Out per bucket."""

    ins: dict[tuple[str, int], int]
    outs: dict[str, int]


def as_measured(templates: dict[int, RankTemplate], whatif: WhatIf, measured_layout: bool) -> bool:
    """Whether the backward is laid out as measured: the job's own buckets, nothing that re-cuts the backward,
    and every rank's measured segments at hand."""
    return measured_layout and not restructured(whatif) and not whatif.ready_groups and all(
        t.bucket_ready_order and len(t.backward_segments_us) == len(t.bucket_ready_order) + 1
        for t in templates.values())


def local_dfg(g: GraphBuilder, r: int, t: RankTemplate, profile: Optional[OpProfile], model: JobModel,
              syncs: list[Sync], measured: bool, detail: str) -> RankEnds:
    """One rank's compute chain with its In and Out nodes (see the module doc): `measured`, the backward cut
    at the measured buckets' ready points (`syncs`, one In node each: the partition pass adds pieces); else
    uncut, with no In or Out node.
    Every compute node carries its phase, and the profiled ops it is made of, for the compute passes."""
    dev = f"rank{r}.compute"

    def phase(name: str, kind: str, which: str, duration: float, a: float = 0.0, b: float = 1.0) -> list[int]:
        return phase_nodes(g, r, dev, name, kind, profile, which, a, b, duration, detail)

    ins: dict[tuple[str, int], int] = {}
    outs: dict[str, int] = {}
    blocking = measured and model.blocking_collectives  # each collective holds the compute after it (FSDP, CPU)
    waiting: list[int] = []  # blocking collectives' Out nodes the next compute waits for
    delays = {s.key: s.delay_us for s in syncs if s.delay_us > 0}

    def cut_phase(name: str, kind: str, which: str, order: list[str], segments: list[float]) -> None:
        """A phase laid out as measured: its segments, each followed by the In node of the collective handed over
        there (blocking: and the Out node the next segment waits for)."""
        bounds = measured_cuts(profile, order, segments, which)
        for k, seg in enumerate(segments):
            nodes = phase(f"r{r}.{name}.seg{k}", kind, which, seg, bounds[k], bounds[k + 1])
            for out in waiting:
                g.edge(out, nodes[0])
            waiting.clear()
            chain.extend(nodes)
            if k < len(order):
                ins[(order[k], 0)] = g.op(f"r{r}.In.{order[k]}.p0", "VIRTUAL", r, None, delays.get(order[k], 0.0))
                g.edge(chain[-1], ins[(order[k], 0)])
                if blocking:
                    outs[order[k]] = g.op(f"r{r}.Out.{order[k]}", "VIRTUAL", r, None, 0.0)
                    waiting.append(outs[order[k]])

    chain = phase(f"r{r}.accumulate", "FW", "accumulate", t.accumulate_us) if t.accumulate_us > 0 else []
    if blocking and t.forward_order:
        cut_phase("forward", "FW", "forward", t.forward_order, t.forward_segments_us)
    else:
        chain += phase(f"r{r}.forward", "FW", "forward", t.forward_us)
    loss = phase(f"r{r}.loss", "FW", "loss", t.loss_us)
    for out in waiting:
        g.edge(out, loss[0])
    waiting.clear()
    chain += loss
    if measured:
        cut_phase("backward", "BW", "backward", t.bucket_ready_order, t.backward_segments_us)  # enqueue cost in
    else:  # the model's backward compute, to be cut by the tensor-fusion pass
        syncs = []
        chain += phase(f"r{r}.backward.seg0", "BW", "backward",
                       max(0.0, t.backward_us - t.enqueue_cost_us * len(model.buckets)))
    finalize = phase(f"r{r}.finalize", "BW", "finalize", t.finalize_us)
    update = phase(f"r{r}.update", "UPDATE", "update", t.update_us)
    tail = phase(f"r{r}.tail", "IO", "tail", t.tail_us)
    g.chain(chain + finalize + update + tail)
    for s in syncs:
        if s.key not in outs:
            outs[s.key] = g.op(f"r{r}.Out.{s.key}", "VIRTUAL", r, None, 0.0)
        if s.after_update:  # a sharded step's parameter gather: after the update, before the tail
            ins[(s.key, 0)] = g.op(f"r{r}.In.{s.key}.p0", "VIRTUAL", r, None, 0.0)
            g.edge(update[-1], ins[(s.key, 0)])
            g.edge(outs[s.key], tail[0])
        else:
            g.edge(outs[s.key], finalize[0])
    return RankEnds(ins, outs)


def measured_cuts(profile: Optional[OpProfile], order: list[str], segments: list[float],
                  phase: str = "backward") -> list[float]:
    """Fractions of `phase` (the backward; the forward where blocking collectives cut it) at which the measured
    buckets' ready points cut the profiled phase: the profiled iteration's own cuts (so each segment gets the ops
    that ran before that bucket's hook) when it saw every bucket, else the segments' cumulative shares."""
    cuts = profile.phases[phase].cuts if profile is not None and phase in profile.phases else {}
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


def restructured(whatif: WhatIf) -> bool:
    """Re-computation and accumulation are passes on a backward laid out by the model (cut at the collectives'
    ready points, DDP's enqueue cost apart), not on the measured segments (which include that cost)."""
    return whatif.accumulation_steps > 1 or whatif.recompute_segments > 1
