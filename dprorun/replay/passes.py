"""Passes on the global DFG: each takes a ReplayGraph and returns a new one (the input is left as it was).

The graph `replay/synthesize.py` builds is the job's structure: which ops, which collectives, which topology
joins the ranks. The compute what-ifs are passes on that graph:
  - `scale_compute(graph, forward, backward)`: a measured compute variant (torch.compile of the model or of its
    blocks, bf16 autocast): every forward node (and re-computed forward) x forward, every backward-compute node
    x backward; DDP's per-bucket enqueue cost, the loss, finalize, update and tail are left as they were;
  - `scale_ops(graph, op_scale)`: the per-op what-if (`dpro replay --op-scale PATTERN=FACTOR`): each node made of
    profiled ops takes, per op, the factor of every pattern that op matches (by name, module scope or
    name@scope), weighted by the op's share of the node;
  - `coarsen(graph)` (replay/coarsen.py): chains of compute ops merged (dPRO's coarsened view).
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
from dprorun.replay.engine import PHASE_CODE, ReplayGraph


def scale_compute(graph: ReplayGraph, forward: float, backward: float) -> ReplayGraph:
    if forward == 1.0 and backward == 1.0:
        return graph
    factor = np.ones(graph.size)
    factor[np.isin(graph.phases, [PHASE_CODE["forward"], PHASE_CODE["recompute"]])] = forward
    factor[graph.phases == PHASE_CODE["backward"]] = backward
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


def op_patterns(op: ProfiledOp, op_scale: dict[str, float]) -> list[str]:
    """The `op_scale` patterns a profiled op matches (by name, module scope or name@scope)."""
    return [pattern for pattern in op_scale
            if fnmatchcase(op.name, pattern) or (op.scope and fnmatchcase(op.scope, pattern))
            or fnmatchcase(op.label, pattern)]
