"""Passes on the global DFG: each takes a ReplayGraph and returns a new one (the input is left as it was).

The graph `replay/synthesize.py` builds is the job's structure: which ops, which collectives, which topology
joins the ranks. The compute what-ifs are passes on that graph:
  - `scale_compute(graph, forward, backward)`: a measured compute variant (torch.compile of the model or of its
    blocks, bf16 autocast): every forward node (and re-computed forward) x forward, every backward-compute node
    x backward; DDP's per-bucket enqueue cost, the loss, finalize, update and tail are left as they were;
  - `scale_ops(graph, op_scale)`: the per-op what-if (`dpro replay --op-scale PATTERN=FACTOR`): each node made of
    profiled ops takes, per op, the factor of every pattern that op matches (by name, module scope or
    name@scope), weighted by the op's share of the node;
  - `scale_devices(graph, factors)`: the nodes on the devices a glob pattern names x a factor (BytePS's stage
    what-if: replay/pipeline.scale_stages);
  - `coarsen(graph)` (replay/coarsen.py): chains of compute ops merged (dPRO's coarsened view).
Two passes change the structure of the ranks' local DFGs (nodes inserted into each rank's compute chain) and
then regenerate the topology that joins them, if the graph had one (`replay/comm.set_network`):
  - `recompute(graph, segments)`: activation checkpointing; after each backward segment (the ops between two
    collectives' ready points) a node that re-runs the segment's share (by backward time) of (segments-1)/segments
    of the rank's forward (the forward of one checkpointed segment is not re-run);
  - `accumulate(graph, steps)`: gradient accumulation over `steps` micro-batches of the same global batch:
    forward, loss, backward and re-computation x 1/steps, and before them the first steps-1 micro-batches,
    which run without synchronisation (DDP's no_sync: no bucket is handed over, so no enqueue cost); the last
    micro-batch's backward overlaps the collectives as before.
  Both read the compute chain as `synthesize` lays it out; apply `recompute` before `accumulate`.
Compute passes read the nodes' phases and profiled ops (ReplayGraph.phases / .parts). `coarsen` keeps both (a
merged chain's ops by share; its phase where the chain has one), so `scale_ops` gives the same iteration time
before or after it; `scale_compute` runs on the graph as built, before chains of several phases are merged.
"""
from __future__ import annotations

from dataclasses import replace
from fnmatch import fnmatchcase

import numpy as np

from dprorun.fsutil import UnanswerableError
from dprorun.graph.local import ProfiledOp
from dprorun.replay.comm import plan_of, set_network
from dprorun.replay.engine import KIND_CODE, PHASE_CODE, GraphBuilder, ReplayGraph


def scale_compute(graph: ReplayGraph, forward: float, backward: float) -> ReplayGraph:
    if forward == 1.0 and backward == 1.0:
        return graph
    factor = np.ones(graph.size)
    forwards = np.isin(graph.phases, [PHASE_CODE["forward"], PHASE_CODE["recompute"]])
    backwards = graph.phases == PHASE_CODE["backward"]
    factor[forwards] = forward
    factor[backwards] = backward
    # micro-batches accumulated before the forward (DDP's no_sync): forwards and backwards in the graph's own mix
    f, b = float(graph.durations[forwards].sum()), float(graph.durations[backwards].sum())
    factor[graph.phases == PHASE_CODE["accumulate"]] = (f * forward + b * backward) / (f + b) if f + b > 0 else 1.0
    return replace(graph, durations=graph.durations * factor)


def scale_ops(graph: ReplayGraph, op_scale: dict[str, float]) -> tuple[ReplayGraph, set[str]]:
    """The graph with the matching profiled ops scaled, and the patterns that matched some op."""
    if not op_scale:
        return graph, set()
    if not graph.parts:
        raise UnanswerableError("--op-scale needs the profiler's ops, which this run lacks (no kineto_trace.json, "
                                "or run without --no-kineto)")
    durations = graph.durations.copy()
    matched: set[str] = set()
    for node, parts in graph.parts.items():
        total = 0.0
        for op, share in parts:
            patterns = op_patterns(op, op_scale) if op is not None else []
            matched.update(patterns)
            total += share * float(np.prod([op_scale[p] for p in patterns])) if patterns else share
        durations[node] *= total
    return replace(graph, durations=durations), matched


def scale_devices(graph: ReplayGraph, factors: dict[str, float]) -> ReplayGraph:
    """Every node on a device whose name matches a glob pattern, its duration x that pattern's factor (the
    product where several match): a faster link, a BytePS stage's service (replay/pipeline.scale_stages)."""
    factor = np.ones(len(graph.device_names))
    for d, name in enumerate(graph.device_names):
        for pattern, value in factors.items():
            if fnmatchcase(name, pattern):
                factor[d] *= value
    on_device = graph.devices >= 0
    durations = graph.durations.copy()
    durations[on_device] = durations[on_device] * factor[graph.devices[on_device]]
    return replace(graph, durations=durations)


def op_patterns(op: ProfiledOp, op_scale: dict[str, float]) -> list[str]:
    """The `op_scale` patterns a profiled op matches (by name, module scope or name@scope)."""
    return [pattern for pattern in op_scale
            if fnmatchcase(op.name, pattern) or (op.scope and fnmatchcase(op.scope, pattern))
            or fnmatchcase(op.label, pattern)]


def recompute(graph: ReplayGraph, segments: int) -> ReplayGraph:
    """Activation checkpointing in `segments` segments (see the module doc); 0 or 1: the graph as it is."""
    if segments <= 1:
        return graph
    if graph.meta.get("accumulation_steps", 1) > 1:
        raise ValueError("apply recompute before accumulate (the micro-batches would be read as backward)")
    edit = LocalEdit(graph)
    for rank in edit.ranks():
        forward = edit.phase_sum(rank, "forward")
        chunks = edit.backward_segments(rank)
        totals = [float(graph.durations[nodes].sum()) for nodes in chunks]
        backward = sum(totals)
        for k, (nodes, total) in enumerate(zip(chunks, totals)):
            share = total / backward if backward > 0 else 1.0 / len(chunks)
            node = edit.builder.op(f"r{rank}.backward.seg{k}.recompute", "BW", rank, edit.device_of(nodes[-1]),
                                   forward * (segments - 1) / segments * share, phase="recompute")
            edit.insert_after(nodes[-1], [node])
    return edit.finish({"recompute_segments": segments})


def accumulate(graph: ReplayGraph, steps: int) -> ReplayGraph:
    """Gradient accumulation over `steps` micro-batches (see the module doc); 1: the graph as it is."""
    if steps <= 1:
        return graph
    if graph.meta.get("accumulation_steps", 1) > 1:
        raise ValueError("the graph already accumulates gradients")
    edit = LocalEdit(graph)
    scaled = [PHASE_CODE[p] for p in ("forward", "loss", "backward", "recompute")]
    for rank in edit.ranks():
        first = edit.phase_nodes(rank, "forward")
        if not len(first):
            continue
        device = edit.device_of(int(first[0]))
        chain = []
        for phase, kind in (("forward", "FW"), ("loss", "FW"), ("backward", "BW"), ("recompute", "BW")):
            total = edit.phase_sum(rank, phase)
            if phase != "recompute" or total > 0:
                chain.append(edit.builder.op(f"r{rank}.microbatches.{phase}", kind, rank, device,
                                             (steps - 1) / steps * total, phase=phase))
        edit.insert_before(int(first[0]), chain)
    durations = np.asarray(edit.builder.durations)
    local = np.arange(len(durations)) < edit.plan.local_nodes  # the micro-batches are not scaled again
    durations[local & np.isin(np.asarray(edit.builder.phases), scaled)] /= steps
    edit.builder.durations = durations.tolist()
    return edit.finish({"accumulation_steps": steps})


class LocalEdit:
    """Nodes inserted into the ranks' local DFGs of a built graph (nodes [0, local_nodes) of its communication
    plan): new nodes are appended, edges redirected once at the end, the plan's In and Out nodes keep their ids;
    `finish` regenerates the topology if the graph had one."""

    def __init__(self, graph: ReplayGraph) -> None:
        self.graph = graph
        self.plan = plan_of(graph)
        self.local = self.plan.local_nodes
        self.builder = GraphBuilder.prefix_of(graph, self.local)
        self.redirect_src: dict[int, int] = {}  # node -> the last node inserted after it (takes its successors)
        self.redirect_dst: dict[int, int] = {}  # node -> the first node inserted before it (takes its predecessors)
        self.added: list[tuple[int, int]] = []

    def ranks(self) -> list[int]:
        ranks = self.graph.ranks[:self.local]
        return sorted(int(r) for r in np.unique(ranks[ranks >= 0]))

    def phase_nodes(self, rank: int, phase: str) -> np.ndarray:
        """The rank's nodes of that phase, in the order they were built (the compute chain's order)."""
        return np.flatnonzero((self.graph.ranks[:self.local] == rank)
                              & (self.graph.phases[:self.local] == PHASE_CODE[phase]))

    def phase_sum(self, rank: int, phase: str) -> float:
        return float(self.graph.durations[self.phase_nodes(rank, phase)].sum())

    def device_of(self, node: int) -> str:
        return self.graph.device_names[int(self.graph.devices[node])]

    def backward_segments(self, rank: int) -> list[list[int]]:
        """The rank's backward compute cut where the chain hands over to a collective (an In node or DDP's
        enqueue follows) or leaves the backward."""
        g = self.graph
        segments: list[list[int]] = [[]]
        for node in self.phase_nodes(rank, "backward").tolist():
            segments[-1].append(node)
            successors = g.indices[g.indptr[node]:g.indptr[node + 1]]
            if any(g.kinds[v] == KIND_CODE["VIRTUAL"] or g.phases[v] != PHASE_CODE["backward"] for v in successors):
                segments.append([])
        return [s for s in segments if s]

    def insert_after(self, node: int, chain: list[int]) -> None:
        self.redirect_src[node] = chain[-1]
        self.added += [(node, chain[0])] + list(zip(chain, chain[1:]))

    def insert_before(self, node: int, chain: list[int]) -> None:
        self.redirect_dst[node] = chain[0]
        self.added += list(zip(chain, chain[1:])) + [(chain[-1], node)]

    def finish(self, meta: dict) -> ReplayGraph:
        g = self.builder
        src, dst = np.asarray(g.src, dtype=np.int64), np.asarray(g.dst, dtype=np.int64)
        for redirect, ends in ((self.redirect_src, src), (self.redirect_dst, dst)):
            mapping = np.arange(g.size)
            for old, new in redirect.items():
                mapping[old] = new
            ends[:] = mapping[ends]
        g.src = src.tolist() + [u for u, _ in self.added]
        g.dst = dst.tolist() + [v for _, v in self.added]
        local = g.build(dict(self.graph.meta, comm_plan=replace(self.plan, local_nodes=g.size), **meta))
        if self.graph.size == self.local:
            return local
        whatif = self.plan.whatif
        return set_network(local, whatif.bandwidth_gbit, whatif.bandwidth_scale, whatif.latency_us)
