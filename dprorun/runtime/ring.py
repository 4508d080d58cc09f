"""`--comm-detail ring`: each DDP bucket's all-reduce performed as explicit chunked point-to-point ring steps.

Inside the profiling window, the bucket is split into N chunks and reduced with the textbook ring: N-1
reduce-scatter steps, then N-1 all-gather steps; in every step a rank isends one chunk to its right neighbour
and irecvs one from its left. Every SEND and RECV is timed (posted, completed), so the trace carries real
per-chunk transfers with transaction ids instead of one whole-collective span. Outside the window the bucket
goes to the backend's own all-reduce. One worker thread per rank runs the steps in bucket order, over a
dedicated process group created when DDP is built (every rank builds DDP at the same point).
"""
from __future__ import annotations

import queue
import threading
from typing import Any

from dprorun.graph.topology import ring_schedule
from dprorun.layout import P2PRecord
from dprorun.runtime.session import RankSession


class RingAllreduce:
    def __init__(self, session: RankSession, ddp_index: int):
        import torch.distributed as dist

        self.session = session
        self.ddp_index = ddp_index
        self.group = dist.new_group(backend=None)  # same backend as the job: gloo on CPU, NCCL on GPU
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.jobs: "queue.Queue[Any]" = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="dpro-ring", daemon=True)
        self.thread.start()

    def submit(self, bucket, iteration: int, enqueue_us: float):
        import torch

        future = torch.futures.Future()
        self.jobs.put((bucket.index(), bucket.buffer(), future, iteration, enqueue_us))
        return future

    def _run(self) -> None:
        while True:
            index, tensor, future, iteration, enqueue_us = self.jobs.get()
            try:
                self._allreduce(index, tensor, iteration)
                tensor.div_(self.world)
                future.set_result(tensor)
            except Exception as exc:  # surfaces in the training script as DDP's error
                future.set_exception(exc)

    def _allreduce(self, index: int, tensor, iteration: int) -> None:
        import torch
        import torch.distributed as dist

        session, world, rank = self.session, self.world, self.rank
        right, left = (rank + 1) % world, (rank - 1) % world
        chunks = list(torch.tensor_split(tensor, world))
        scratch = torch.empty_like(chunks[0])
        for stage, step, send_c, recv_c in ring_schedule(rank, world):
            send_chunk, recv_chunk = chunks[send_c], chunks[recv_c]
            if send_chunk.numel() == 0 and recv_chunk.numel() == 0:
                continue
            t_send = session.now_us()
            send_req = dist.isend(send_chunk.contiguous(), right, group=self.group) if send_chunk.numel() else None
            t_recv = session.now_us()
            buf = scratch[: recv_chunk.numel()]
            recv_req = dist.irecv(buf, left, group=self.group) if recv_chunk.numel() else None
            if recv_req is not None:
                recv_req.wait()
            t_recv_done = session.now_us()
            if send_req is not None:
                send_req.wait()
            t_send_done = session.now_us()
            if stage == "reduce_scatter":
                recv_chunk.add_(buf)
            else:
                recv_chunk.copy_(buf)
            nbytes_send = send_chunk.numel() * send_chunk.element_size()
            nbytes_recv = recv_chunk.numel() * recv_chunk.element_size()
            session.records.p2p.append(P2PRecord(iteration, self.ddp_index, index, step, send_c, rank, right, "send", t_send,
                                         t_send_done, nbytes_send))
            session.records.p2p.append(P2PRecord(iteration, self.ddp_index, index, step, recv_c, left, rank, "recv", t_recv,
                                         t_recv_done, nbytes_recv))
