"""Build the global DFG of one profiled iteration from an (aligned) RunTrace.

Per rank (the local DFG):
  - compute ops in observed stream order: the profiler's top-level ops where that iteration was profiled,
    otherwise the hooks' forward span, the backward span cut at every bucket's ready time, and the update;
  - per bucket an In virtual op (after the compute op during which the bucket's last gradient became ready)
    and an Out virtual op (before the update, which waits for every bucket as DDP's finalize does).
Across ranks: each bucket's synchronisation through the communication topology (a ring all-reduce; one per
process group where the script's DDP all-reduces within groups of its own), with
measured SEND/RECV ops where `--comm-detail ring` recorded them and estimated ones (flagged) otherwise; the
Middleman joins SEND and RECV by transaction id.

`replay_graph(dfg)` gives it the replay engine's graph type (each op its measured duration on its device), so the
measured DFG replays with the same engine as the synthesized one: `dpro graph RUN --measured` compares that replay
with the iteration it was measured on (what the dependencies explain, and what lies in the gaps between ops).
"""
from __future__ import annotations

import bisect
from typing import Optional

from dprorun.graph.dfg import GlobalDFG
from dprorun.replay.engine import GraphBuilder, ReplayGraph
from dprorun.graph.topology import SyncSpec, join_transactions, ring_allreduce
from dprorun.trace.model import Op, OpKind, RankTrace, RunTrace, ddp_groups
from dprorun.fsutil import UnanswerableError

COMPUTE_KINDS = (OpKind.FW, OpKind.BW, OpKind.UPDATE, OpKind.IO, OpKind.OTHER)


def bucket_ready_times(trace: RankTrace, iteration: int) -> dict[str, float]:
    """Tensor key -> time its last gradient became ready (falls back to the bucket's enqueue time)."""
    ready = {name: t for i, name, t in trace.grad_ready if i == iteration}
    out: dict[str, float] = {}
    for bucket in trace.buckets:
        key = bucket.key
        times = [ready[p] for p in bucket.params if p in ready]
        if times:
            out[key] = max(times)
    for op in trace.ops:
        if op.iteration == iteration and op.tensor and op.kind in (OpKind.QUEUE, OpKind.COMM) and op.source == "hooks":
            out.setdefault(op.tensor, op.start_us)
    return out


def _compute_ops(trace: RankTrace, iteration: int, ready: dict[str, float]) -> list[Op]:
    detailed = [op for op in trace.ops if op.iteration == iteration and op.source == "kineto"
                and op.stream == "main" and op.kind in COMPUTE_KINDS]
    if detailed:
        return sorted(detailed, key=lambda op: op.start_us)
    phases = sorted((op for op in trace.ops if op.iteration == iteration and op.stream == "phase"),
                    key=lambda op: op.start_us)
    out: list[Op] = []
    for phase in phases:
        if phase.kind is not OpKind.BW:
            out.append(Op(**{**phase.__dict__, "args": {}}))
            continue
        cuts = sorted(t for t in ready.values() if phase.start_us < t < phase.end_us)
        edges = [phase.start_us] + cuts + [phase.end_us]
        for k, (a, b) in enumerate(zip(edges, edges[1:])):
            out.append(Op(name=f"{phase.name}.seg{k}", kind=OpKind.BW, rank=trace.rank, start_us=a, end_us=b,
                          iteration=iteration, stream="main", host=trace.host, source="hooks",
                          args={"granularity": "backward cut at bucket-ready times"}))
    return out


def _sync_window(trace: RankTrace, iteration: int, tensor: str) -> tuple[float, float, int]:
    comm = [op for op in trace.ops if op.iteration == iteration and op.tensor == tensor and op.kind is OpKind.COMM
            and op.source == "hooks" and op.phase in ("transmit", "queue+transmit")]
    if not comm:
        return 0.0, 0.0, 0
    return comm[0].start_us, comm[0].end_us, comm[0].nbytes


def build_global_dfg(run: RunTrace, iteration: Optional[int] = None) -> GlobalDFG:
    ranks = sorted(run.ranks)
    if iteration is None:
        common = set.intersection(*(set(run.ranks[r].profiled_iterations) for r in ranks))
        kineto = set.intersection(*(set(run.ranks[r].meta.get("kineto_iterations", [])) for r in ranks))
        choices = sorted(common & kineto) or sorted(common)
        if not choices:
            raise UnanswerableError("no profiled iteration is complete on every rank")
        iteration = choices[0]
    dfg = GlobalDFG()
    host_of = {r: run.ranks[r].host for r in ranks}
    specs: dict[str, list[SyncSpec]] = {}
    for rank in ranks:
        trace = run.ranks[rank]
        ready = bucket_ready_times(trace, iteration)
        compute = _compute_ops(trace, iteration, ready)
        ids = [dfg.add(Op(**{**op.__dict__, "name": f"{op.name}#{k}", "args": dict(op.args)}))
               for k, op in enumerate(compute)]
        dfg.chain(ids)
        starts = [op.start_us for op in compute]
        update_ids = [i for i, op in zip(ids, compute) if op.kind is OpKind.UPDATE]
        measured = {(op.phase, op.txn_id): op for op in trace.ops
                    if op.iteration == iteration and op.phase in ("send", "recv") and op.txn_id}
        for tensor, ready_us in sorted(ready.items(), key=lambda kv: kv[1]):
            start, end, nbytes = _sync_window(trace, iteration, tensor)
            in_id = dfg.add(Op(name=f"In.{tensor}", kind=OpKind.VIRTUAL, rank=rank, start_us=ready_us,
                               end_us=ready_us, iteration=iteration, stream="virtual", host=trace.host,
                               tensor=tensor, nbytes=nbytes, source="graph"))
            out_id = dfg.add(Op(name=f"Out.{tensor}", kind=OpKind.VIRTUAL, rank=rank, start_us=end, end_us=end,
                                iteration=iteration, stream="virtual", host=trace.host, tensor=tensor,
                                nbytes=nbytes, source="graph"))
            position = bisect.bisect_right(starts, ready_us) - 1
            if position >= 0:
                dfg.edge(ids[position], in_id)
            if update_ids:
                dfg.edge(out_id, update_ids[0])
            specs.setdefault(tensor, []).append(SyncSpec(rank, in_id, out_id, start, end, nbytes, measured))
    groups = ddp_groups(run) or [ranks]  # the script's own DDP groups: a ring each
    for tensor, tensor_specs in sorted(specs.items()):
        if len(tensor_specs) != len(ranks):
            dfg.notes.append(f"{tensor}: recorded on {len(tensor_specs)} of {len(ranks)} ranks, not synchronised")
            continue
        for group in groups:
            ring_allreduce(dfg, tensor, iteration, [spec for spec in tensor_specs if spec.rank in group], host_of)
    join_transactions(dfg)
    estimated = sum(1 for op in dfg.nodes if op.args.get("estimated"))
    if estimated:
        dfg.notes.append(f"{estimated} SEND/RECV ops are estimated from whole-collective spans (only the "
                         "collective's time was measured; run with --comm-detail ring to measure every chunk)")
    return dfg


def replay_graph(dfg: GlobalDFG) -> ReplayGraph:
    """The measured DFG as a ReplayGraph: compute ops on their rank's compute device with their measured
    durations; a SEND on the link to its peer with the measured transfer (estimated ones: the collective's span
    in equal slices); a RECV joins its SEND and takes no device; In/Out and other virtual ops take no time.
    The profiler's gaps between top-level ops (Python between them, waits) are not ops, so a rank's replayed
    compute is its ops' busy time."""
    g = GraphBuilder()
    for op in dfg.nodes:
        duration = max(0.0, op.end_us - op.start_us)
        if op.kind is OpKind.VIRTUAL:
            g.op(op.name, "VIRTUAL", op.rank, None, 0.0)
        elif op.kind in (OpKind.COMM, OpKind.QUEUE):
            if op.phase == "send" and op.peer is not None:
                g.op(op.name, "COMM", op.rank, f"link{op.rank}->{op.peer}", duration)
            elif op.phase == "recv":
                g.op(op.name, "VIRTUAL", op.rank, None, 0.0)
            else:  # a server's aggregation, a whole collective
                g.op(op.name, op.kind.value, op.rank, f"{op.stream or 'comm'}{op.rank}", duration)
        else:
            g.op(op.name, op.kind.value, op.rank, f"rank{op.rank}.compute", duration)
    for v, preds in enumerate(dfg.preds):
        for u in preds:
            g.edge(u, v)
    return g.build({"measured": True, "ranks_built": len({op.rank for op in dfg.nodes}),
                    "world_size": len({op.rank for op in dfg.nodes})})
