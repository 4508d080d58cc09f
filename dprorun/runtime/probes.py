"""Clock probes at the end of the profiling window: ping-pong rounds between rank 0 and every other rank, each
side keeping its own timestamps (the alignment's hard intervals)."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dprorun.runtime.session import RankSession

PROBE_ROUNDS = 40



def probe_clocks(session: RankSession, group, rounds: int = PROBE_ROUNDS) -> None:
    """Ping-pong between rank 0 and every other rank; each side keeps its own timestamps (session.now_us,
    so an injected test skew applies to them as to every other timestamp).

    origin (rank 0): t0 before sending, t3 after the echo arrived; echo (peer): t1 after the ping arrived,
    t2 before answering. Causality gives t0 - t1 <= offset(peer -> rank 0) <= t3 - t2 for every round.
    """
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    token = torch.zeros(1)
    for peer in range(1, world):
        if rank == 0:
            for k in range(rounds):
                t0 = session.now_us()
                dist.send(token, dst=peer, group=group)
                dist.recv(token, src=peer, group=group)
                t3 = session.now_us()
                session.records.probes.append([peer, k, "origin", t0, t3])
        elif rank == peer:
            for k in range(rounds):
                dist.recv(token, src=0, group=group)
                t1 = session.now_us()
                t2 = session.now_us()
                dist.send(token, dst=0, group=group)
                session.records.probes.append([0, k, "echo", t1, t2])
