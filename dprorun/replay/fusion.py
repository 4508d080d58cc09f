"""Tensor fusion and partition as passes on the global DFG: the collectives a graph's ranks hand over, regrouped
or split.

`set_buckets(graph, syncs, partitions, bucket_partitions)`: the graph's collectives replaced by `syncs`, a bucket
plan (`whatif.plan_syncs` makes one: DDP's re-bucketing, the optimizer's explicit groups, Horovod's fused
responses, TensorFlow's packs). Every rank's backward is re-cut at the new collectives' ready points (fractions
of its backward compute; an op a point falls in is cut there, as the profile's own slice does), DDP's
per-collective enqueue cost after each cut, one In node per piece after it, one Out node per collective before
finalize; the topology is regenerated if the graph had one. Exact on a backward laid out by the model (uncut, as
`synthesize` builds it for such questions, or cut by an earlier call); on one laid out as measured (each
segment its own measured duration, the measured hand-overs inside), the measured hand-overs are taken out and
the ops placed by time.
`partition(graph, partitions, bucket_partitions)`: each collective split into pieces (In nodes per piece at the
same ready point), the backward as it is.

Both read a rank's compute chain (its nodes on its compute device, in order) and rebuild the local DFGs; apply
them before `recompute` and `accumulate`, which insert nodes into the backward.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable, Optional

import numpy as np

from dprorun.graph.local import OpProfile, PhaseProfile
from dprorun.replay.comm import CommPlan, plan_of, set_network
from dprorun.replay.engine import KIND_NAMES, PHASE_CODE, PHASES, GraphBuilder, ReplayGraph
from dprorun.replay.local_dfg import phase_nodes
from dprorun.replay.whatif import Sync

BACKWARD = (PHASE_CODE["backward"], PHASE_CODE["enqueue"])


def set_buckets(graph: ReplayGraph, syncs: list[Sync], partitions: int = 1,
                bucket_partitions: Optional[dict[str, int]] = None, measured: bool = False) -> ReplayGraph:
    """Tensor fusion (see the module doc): the graph with `syncs` as its collectives; `measured`: they are the
    job's own buckets (their measured transmissions price the job's own network)."""
    return _rejoin(graph, syncs, partitions, bucket_partitions or {}, recut=True, measured=measured)


def partition(graph: ReplayGraph, partitions: int = 1,
              bucket_partitions: Optional[dict[str, int]] = None) -> ReplayGraph:
    """Partition (see the module doc): every collective in `partitions` pieces, or per collective key."""
    plan = plan_of(graph)
    if partitions == plan.whatif.partitions and (bucket_partitions or {}) == plan.whatif.bucket_partitions:
        return graph
    return _rejoin(graph, plan.syncs, partitions, bucket_partitions or {}, recut=False,
                   measured=plan.measured_layout)


def _rejoin(graph: ReplayGraph, syncs: list[Sync], partitions: int, bucket_partitions: dict[str, int],
            recut: bool, measured: bool) -> ReplayGraph:
    plan = plan_of(graph)
    if graph.meta.get("recompute_segments", 0) > 1 or graph.meta.get("accumulation_steps", 1) > 1:
        raise ValueError("tensor fusion and partition re-cut the backward: apply them before recompute and "
                         "accumulate")
    whatif = replace(plan.whatif, partitions=partitions, bucket_partitions=dict(bucket_partitions))
    g = GraphBuilder()
    ins: dict[tuple[str, int], list[int]] = {(s.key, p): [] for s in syncs for p in range(whatif.pieces(s.key))}
    outs: dict[str, list[int]] = {s.key: [] for s in syncs}
    for r in range(int(graph.meta["ranks_built"])):
        rank_ins, rank_outs = _rejoin_rank(graph, plan, g, r, syncs, whatif.pieces, recut)
        for key, node in rank_ins.items():
            ins[key].append(node)
        for key, node in rank_outs.items():
            outs[key].append(node)
    new_plan = replace(plan, whatif=whatif, syncs=list(syncs), measured_layout=measured, ins=ins, outs=outs,
                       local_nodes=g.size)
    meta = dict(graph.meta, buckets=len(syncs), partitions=partitions, comm_plan=new_plan)
    if recut:
        meta["backward_layout"] = "model"
    local = g.build(meta)
    if graph.size == plan.local_nodes:
        return local
    return set_network(local, whatif.bandwidth_gbit, whatif.bandwidth_scale, whatif.latency_us)


def _rejoin_rank(graph: ReplayGraph, plan: CommPlan, g: GraphBuilder, r: int, syncs: list[Sync],
                 pieces: Callable[[str], int], recut: bool) -> tuple[dict[tuple[str, int], int], dict[str, int]]:
    """Rank r's local DFG rebuilt into g: its compute chain copied, the backward re-cut (recut) or kept, In nodes
    per piece at each collective's ready point, Out nodes into finalize."""
    chain = compute_chain(graph, r, plan.local_nodes)
    delays = {s.key: s.delay_us for s in syncs}
    ins: dict[tuple[str, int], int] = {}

    def attach(after: int, key: str) -> None:
        for p in range(pieces(key)):
            ins[(key, p)] = g.op(f"r{r}.In.{key}.p{p}", "VIRTUAL", r, None, delays.get(key, 0.0))
            g.edge(after, ins[(key, p)])

    in_backward = np.isin(graph.phases[chain], BACKWARD)
    if not in_backward.any():
        raise ValueError(f"rank {r}'s compute chain has no backward to hand collectives over from")
    start = int(np.argmax(in_backward))  # the backward block: its first node, and the first node after it
    after = np.flatnonzero(~in_backward[start:])
    stop = start + int(after[0]) if len(after) else len(chain)
    new_chain = [_copy(g, graph, n) for n in chain[:start]]
    if recut:
        new_chain += _recut_backward(graph, plan, g, r, chain[start:stop], [s for s in syncs if not s.after_update],
                                     attach)
    else:
        attached = _attachments(graph, plan, r)
        for n in chain[start:stop]:
            new_chain.append(_copy(g, graph, n))
            for key in attached.get(n, []):
                attach(new_chain[-1], key)
    tail = [_copy(g, graph, n) for n in chain[stop:]]
    g.chain(new_chain + tail)
    # a sharded step's parameter gathers: handed over by the update's last node, before the node after it
    updates = [k for k, n in enumerate(chain[stop:]) if graph.phases[n] == PHASE_CODE["update"]]
    update_at = updates[-1] if updates else len(tail) - 1
    outs = {}
    for s in syncs:
        outs[s.key] = g.op(f"r{r}.Out.{s.key}", "VIRTUAL", r, None, 0.0)
        if s.after_update:
            attach(tail[update_at], s.key)
            if update_at + 1 < len(tail):
                g.edge(outs[s.key], tail[update_at + 1])
        else:
            g.edge(outs[s.key], tail[0])
    return ins, outs


def _recut_backward(graph: ReplayGraph, plan: CommPlan, g: GraphBuilder, r: int, block: list[int],
                    syncs: list[Sync], attach: Callable[[int, str], None]) -> list[int]:
    """The backward's compute, cut at the collectives' ready points: its profiled ops sliced per segment (the
    profile's own slice), DDP's enqueue cost after each cut, the collective's In nodes after that."""
    compute = [n for n in block if graph.phases[n] == PHASE_CODE["backward"]]
    total = float(graph.durations[compute].sum())
    enqueue = plan.enqueue_us[r] if r < len(plan.enqueue_us) else 0.0
    if graph.meta.get("backward_layout") == "measured":  # measured segments hold the measured hand-overs
        total = max(0.0, total - enqueue * len(plan.syncs))
    ops = []
    for n in compute:
        for op, _ in graph.parts.get(n, ()):
            if op is not None and (not ops or ops[-1] is not op):
                ops.append(op)
    profile = OpProfile(r, 0, {"backward": PhaseProfile("backward", 0.0, ops)}) if ops else None
    device = graph.device_names[int(graph.devices[compute[0]])]
    ordered = sorted(syncs, key=lambda s: s.ready_fraction)
    bounds = [0.0] + [s.ready_fraction for s in ordered] + [1.0]
    detail = graph.meta.get("detail", "ops")
    nodes: list[int] = []
    for k, (a, b) in enumerate(zip(bounds, bounds[1:])):
        nodes += phase_nodes(g, r, device, f"r{r}.backward.seg{k}", "BW", profile, "backward", a, b,
                             total * (b - a), detail)
        if k < len(ordered):
            if enqueue:  # DDP's hook handing the collective over (measured, not model compute)
                nodes.append(g.op(f"r{r}.backward.seg{k}.enqueue", "BW", r, device, enqueue, phase="enqueue"))
            attach(nodes[-1], ordered[k].key)
    return nodes


def _attachments(graph: ReplayGraph, plan: CommPlan, r: int) -> dict[int, list[str]]:
    """Compute node -> the collectives whose In nodes follow it on rank r, in the order they were built."""
    firsts = sorted((plan.ins[(s.key, 0)][r], s.key) for s in plan.syncs if (s.key, 0) in plan.ins)
    predecessor = {}
    for u in range(plan.local_nodes):
        for v in graph.indices[graph.indptr[u]:graph.indptr[u + 1]].tolist():
            predecessor.setdefault(v, u)
    out: dict[int, list[str]] = {}
    for node, key in firsts:
        out.setdefault(predecessor[node], []).append(key)
    return out


def compute_chain(graph: ReplayGraph, r: int, local_nodes: int) -> list[int]:
    """Rank r's nodes on its compute device(s) among the first local_nodes, in chain order."""
    nodes = np.flatnonzero((graph.ranks[:local_nodes] == r) & (graph.devices[:local_nodes] >= 0)).tolist()
    members = set(nodes)
    following, preceded = {}, set()
    for u in nodes:
        for v in graph.indices[graph.indptr[u]:graph.indptr[u + 1]].tolist():
            if v in members:
                following[u] = v
                preceded.add(v)
    starts = [u for u in nodes if u not in preceded]
    if len(starts) != 1:
        raise ValueError(f"rank {r}'s compute ops are not one chain ({len(starts)} starts)")
    chain = [starts[0]]
    while chain[-1] in following:
        chain.append(following[chain[-1]])
    return chain


def _copy(g: GraphBuilder, graph: ReplayGraph, n: int) -> int:
    d = int(graph.devices[n])
    device = graph.device_names[d] if d >= 0 else None
    return g.op(graph.names[n], KIND_NAMES[graph.kinds[n]], int(graph.ranks[n]), device, float(graph.durations[n]),
                capacity=int(graph.device_capacity[d]) if d >= 0 else 1, phase=PHASES[graph.phases[n]],
                parts=graph.parts.get(n, ()))
