"""Communication topologies: how one tensor's synchronisation becomes SEND/RECV ops between ranks.

Ring all-reduce (DDP over gloo/NCCL, Horovod): 2(N-1) steps; at step s rank r sends one chunk to r+1 and
receives one from r-1. Parameter server (BytePS, MXNet): each worker PUSHes its part to the server owning it
(SEND worker -> RECV server), the server aggregates, then answers each worker's PULL (SEND server -> RECV worker).
Each SEND and its RECV share a transaction id (tensor, iteration, step, chunk, sender, receiver); the Middleman
(`join_transactions`) adds the SEND -> RECV edge for every id.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from dprorun.graph.dfg import GlobalDFG
from dprorun.trace.model import Op, OpKind


def ring_schedule(rank: int, world: int) -> list[tuple[str, int, int, int]]:
    """[(stage, step, send_chunk, recv_chunk)] for one rank: N-1 reduce-scatter then N-1 all-gather steps."""
    steps = []
    for s in range(world - 1):
        steps.append(("reduce_scatter", s, (rank - s) % world, (rank - s - 1) % world))
    for s in range(world - 1):
        steps.append(("all_gather", world - 1 + s, (rank + 1 - s) % world, (rank - s) % world))
    return steps


def transaction_id(tensor: str, iteration: int, step: int, chunk: int, src: int, dst: int) -> str:
    return f"{tensor}.i{iteration}.s{step}.c{chunk}.{src}->{dst}"


@dataclass
class SyncSpec:
    """One tensor's synchronisation on one rank: where it starts and ends in that rank's local DFG."""

    rank: int
    in_node: int
    out_node: int
    start_us: float  # transmission start (after queueing)
    end_us: float
    nbytes: int
    measured: Optional[dict] = None  # txn id -> measured SEND/RECV Op (`--comm-detail ring`)


def ring_allreduce(dfg: GlobalDFG, tensor: str, iteration: int, specs: list[SyncSpec], host_of: dict) -> None:
    """Add the ring's SEND/RECV ops for one tensor; measured ops where recorded, else estimated from the
    collective's span (equal slices, marked `estimated`, granularity `collective`)."""
    ring = sorted(specs, key=lambda s: s.rank)
    world = len(ring)
    position = {spec.rank: k for k, spec in enumerate(ring)}
    for spec in ring:
        me = position[spec.rank]
        right, left = ring[(me + 1) % world].rank, ring[(me - 1) % world].rank
        schedule = ring_schedule(me, world)
        slice_us = max(spec.end_us - spec.start_us, 0.0) / max(1, len(schedule))
        previous: list[int] = [spec.in_node]
        chunk_bytes = spec.nbytes // world if world else spec.nbytes
        for stage, step, send_c, recv_c in schedule:
            current = []
            for role, chunk, src, dst in (("send", send_c, spec.rank, right), ("recv", recv_c, left, spec.rank)):
                txn = transaction_id(tensor, iteration, step, chunk, src, dst)
                measured = (spec.measured or {}).get((role, txn))
                if measured is not None:
                    op = Op(**{**measured.__dict__, "name": f"{role}.{tensor}.s{step}.c{chunk}",
                               "args": dict(measured.args)})
                else:
                    start = spec.start_us + step * slice_us
                    op = Op(name=f"{role}.{tensor}.s{step}.c{chunk}", kind=OpKind.COMM, rank=spec.rank,
                            start_us=start, end_us=start + slice_us, iteration=iteration, stream="comm",
                            host=host_of.get(spec.rank, ""), tensor=tensor, nbytes=chunk_bytes,
                            peer=dst if role == "send" else src, chunk=chunk, step=step, txn_id=txn, phase=role,
                            source="synth", granularity="collective",
                            args={"estimated": True, "stage": stage})
                node = dfg.add(op)
                for p in previous:
                    dfg.edge(p, node)
                current.append(node)
            previous = current
        for p in previous:
            dfg.edge(p, spec.out_node)


def parameter_server(dfg: GlobalDFG, tensor: str, iteration: int, workers: list[SyncSpec],
                     server_of_part: list[int], host_of: dict, durations: Optional[dict] = None) -> None:
    """PUSH/PULL between every worker and the server of each part; servers aggregate all workers' PUSHes.

    `server_of_part[k]` is the rank acting as server for part k. `durations` maps ("push"|"pull"|"aggregate",
    part) -> µs where measured; otherwise zero-length placeholders marked `estimated`.
    """
    durations = durations or {}
    parts = len(server_of_part)
    for part, server in enumerate(server_of_part):
        agg = dfg.add(Op(name=f"aggregate.{tensor}.p{part}", kind=OpKind.COMM, rank=server, start_us=0.0,
                         end_us=durations.get(("aggregate", part), 0.0), iteration=iteration,
                         stream=f"server{server}", tensor=tensor, phase="aggregate", source="synth",
                         args={"estimated": ("aggregate", part) not in durations}))
        for w in workers:
            part_bytes = w.nbytes // parts
            for role, src, dst in (("push", w.rank, server), ("pull", server, w.rank)):
                txn = transaction_id(f"{tensor}.{role}", iteration, 0, part, src, dst)
                dur = durations.get((role, part), 0.0)
                common = dict(kind=OpKind.COMM, iteration=iteration, tensor=tensor, nbytes=part_bytes, chunk=part,
                              step=0, txn_id=txn, source="synth", args={"estimated": (role, part) not in durations})
                send = dfg.add(Op(name=f"{role}.send.{tensor}.p{part}.w{w.rank}", rank=src, start_us=0.0,
                                  end_us=dur, stream="comm", peer=dst, phase="send", **common))
                recv = dfg.add(Op(name=f"{role}.recv.{tensor}.p{part}.w{w.rank}", rank=dst, start_us=0.0,
                                  end_us=dur, stream="comm", peer=src, phase="recv", **common))
                if role == "push":
                    dfg.edge(w.in_node, send)
                    dfg.edge(recv, agg)
                else:
                    dfg.edge(agg, send)
                    dfg.edge(recv, w.out_node)


def join_transactions(dfg: GlobalDFG) -> int:
    """The Middleman: an edge from every SEND to the RECV with the same transaction id."""
    sends = {op.txn_id: i for i, op in enumerate(dfg.nodes) if op.phase == "send" and op.txn_id}
    joined = 0
    for i, op in enumerate(dfg.nodes):
        if op.phase == "recv" and op.txn_id in sends:
            dfg.edge(sends[op.txn_id], i)
            joined += 1
    return joined
