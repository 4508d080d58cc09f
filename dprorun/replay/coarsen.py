"""Coarsening (dPRO's coarsened view), a pass on the replay graph: every chain of compute ops between
communication boundaries becomes one op.

Op v joins the op u before it when u -> v is u's only out-edge and v's only in-edge, both run on the same
device (a rank's compute stream) and neither is communication or virtual. Such a chain runs back to back on a
device only it uses in between, so the merged op (its durations summed) replays to the same times at its ends:
the iteration time is unchanged (`tests/test_replay.py` checks it on real runs), with far fewer ops. The
optimizer's search replays this view; `synthesize(detail="coarse")` builds it directly.
"""
from __future__ import annotations

import numpy as np

from dprorun.replay.engine import KIND_CODE, KIND_NAMES, PHASES, GraphBuilder, ReplayGraph

_KEEP = {KIND_CODE["COMM"], KIND_CODE["QUEUE"], KIND_CODE["VIRTUAL"]}


def coarsen(graph: ReplayGraph) -> ReplayGraph:
    """The graph with every mergeable chain of compute ops as one op (named by the chain's common prefix, the
    part before ':' of op-level names, else `first..last`); edges between chains kept, duplicates dropped."""
    n = graph.size
    out_degree = np.diff(graph.indptr)
    in_degree = np.bincount(graph.indices, minlength=n) if n else np.zeros(0, dtype=np.int64)
    head = np.arange(n)
    merges_into = np.full(n, -1)
    for u in range(n):
        if out_degree[u] != 1 or graph.kinds[u] in _KEEP or graph.devices[u] < 0:
            continue
        v = int(graph.indices[graph.indptr[u]])
        if in_degree[v] == 1 and graph.kinds[v] not in _KEEP and graph.devices[v] == graph.devices[u] \
                and graph.ranks[v] == graph.ranks[u]:
            merges_into[v] = u
    # each chain in order from its first op (the one that merges into nothing), following the unique successor
    follows = np.full(n, -1)
    for v in range(n):
        if merges_into[v] >= 0:
            follows[merges_into[v]] = v
    members: dict[int, list[int]] = {}
    for h in range(n):
        if merges_into[h] >= 0:
            continue
        chain = [h]
        while follows[chain[-1]] >= 0:
            chain.append(int(follows[chain[-1]]))
        head[chain] = h
        members[h] = chain
    builder = GraphBuilder()
    new_id: dict[int, int] = {}
    for h, chain in members.items():
        device = graph.device_names[graph.devices[h]] if graph.devices[h] >= 0 else None
        capacity = int(graph.device_capacity[graph.devices[h]]) if graph.devices[h] >= 0 else 1
        phases = {int(graph.phases[v]) for v in chain}
        new_id[h] = builder.op(_chain_name([graph.names[v] for v in chain]), _kind_name(graph.kinds[h]),
                               int(graph.ranks[h]), device, float(graph.durations[chain].sum()), capacity,
                               phase=PHASES[phases.pop()] if len(phases) == 1 else "",
                               parts=_chain_parts(graph, chain))
    seen: set[tuple[int, int]] = set()
    for u in range(n):
        for e in range(graph.indptr[u], graph.indptr[u + 1]):
            a, b = new_id[int(head[u])], new_id[int(head[graph.indices[e]])]
            if a != b and (a, b) not in seen:
                seen.add((a, b))
                builder.edge(a, b)
    # the communication plan names nodes of the graph as built: a coarsened graph has other ids
    meta = {k: v for k, v in graph.meta.items() if k != "comm_plan"}
    coarse = builder.build(dict(meta, coarsened_from=n))
    return coarse


def _chain_parts(graph: ReplayGraph, chain: list[int]) -> tuple:
    """The profiled ops a merged chain is made of, each with its share of the chain's duration (ops of no
    profiled op as (None, share)); () when none of the chain's nodes has profiled ops."""
    if not any(v in graph.parts for v in chain):
        return ()
    total = float(graph.durations[chain].sum()) or 1.0
    parts = []
    for v in chain:
        weight = float(graph.durations[v]) / total
        parts.extend((op, share * weight) for op, share in graph.parts.get(v, ((None, 1.0),)))
    return tuple(parts)


def _chain_name(names: list[str]) -> str:
    if len(names) == 1:
        return names[0]
    prefixes = {name.split(":", 1)[0] for name in names}
    if len(prefixes) == 1:
        return f"{prefixes.pop()} ({len(names)} ops)"
    return f"{names[0].split(':', 1)[0]}..{names[-1].split(':', 1)[0]} ({len(names)} ops)"


def _kind_name(code: int) -> str:
    return KIND_NAMES[int(code)]
