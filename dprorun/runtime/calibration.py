"""All-reduce calibration at the end of the profiling window: timed collectives of several sizes over the job's
own process group (or Horovod's), idle and beside compute, for the replay's communication cost model."""
from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dprorun.runtime.session import RankSession

CALIBRATION_SIZES = (1 << 12, 1 << 16, 1 << 20, 1 << 22)


def calibrate_allreduce(session: RankSession, reps: int = 5) -> list[list[float]]:
    """A few timed all-reduces of several sizes over the job's own process group (CPU tensors where the job
    is on gloo, the GPU where it is on NCCL): [[bytes, median µs, median transport CPU µs], ...] for the comm
    cost model. Transport CPU is the CPU time the process's other threads (gloo's workers and socket loop)
    spent during the call: this process's CPU time minus the calling thread's."""
    import statistics

    import torch
    import torch.distributed as dist

    device = "cuda" if dist.get_backend() == "nccl" and torch.cuda.is_available() else "cpu"
    rows = []
    for nbytes in CALIBRATION_SIZES:
        tensor = torch.zeros(nbytes // 4, dtype=torch.float32, device=device)
        times, transport_cpu = [], []
        for _ in range(reps):
            dist.barrier()
            start, process_cpu, thread_cpu = time.perf_counter(), time.process_time(), time.thread_time()
            dist.all_reduce(tensor)
            if device == "cuda":
                torch.cuda.synchronize()
            times.append((time.perf_counter() - start) * 1e6)
            others_cpu = (time.process_time() - process_cpu) - (time.thread_time() - thread_cpu)
            transport_cpu.append(max(0.0, others_cpu) * 1e6)
        rows.append([nbytes, statistics.median(times), statistics.median(transport_cpu)])
    return rows


def calibrate_horovod(session: RankSession, reps: int = 5) -> list[list[float]]:
    """Horovod jobs: timed `hvd.allreduce` calls of the calibration sizes, each after an all-reduce of one float
    that lines the ranks up, so each call is one response of its own (negotiation, the wait for the background
    loop's next cycle, the transport): [[bytes, median µs, median transport CPU µs], ...] as for
    torch.distributed jobs. The cost model takes Horovod's bandwidth and per-response latency from it; the
    timeline's fused responses, timed while the ranks compute, include waiting for the other rank."""
    import statistics

    import torch

    hvd = sys.modules["horovod.torch"]
    rows = []
    for nbytes in CALIBRATION_SIZES:
        tensor = torch.zeros(nbytes // 4, dtype=torch.float32)
        times, transport_cpu = [], []
        for k in range(reps):
            hvd.allreduce(torch.zeros(1), name=f"dprorun.calibration.barrier.{nbytes}.{k}")
            start, process_cpu, thread_cpu = time.perf_counter(), time.process_time(), time.thread_time()
            hvd.allreduce(tensor, name=f"dprorun.calibration.{nbytes}", op=hvd.Sum)
            times.append((time.perf_counter() - start) * 1e6)
            others_cpu = (time.process_time() - process_cpu) - (time.thread_time() - thread_cpu)
            transport_cpu.append(max(0.0, others_cpu) * 1e6)
        rows.append([nbytes, statistics.median(times), statistics.median(transport_cpu)])
    return rows


def calibrate_under_compute(session: RankSession, reps: int = 5) -> list[list[float]]:
    """The same all-reduces while every rank computes (a CPU transport only; the GPU's are not on the cores):
    each rank starts one asynchronously and runs small matrix products until it completes, as a backward does
    around the collectives it overlaps. [[bytes, median µs], ...]: what a collective costs when its threads
    must wait for cores the computation holds (the replay's contention model, replay/template.py)."""
    import statistics

    import torch
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return []
    operand = torch.randn(128, 128)
    rows = []
    for nbytes in CALIBRATION_SIZES[1:3]:  # 64 KiB and 1 MiB: the slow-down is per call, not per byte
        tensor = torch.zeros(nbytes // 4, dtype=torch.float32)
        times = []
        for _ in range(reps):
            dist.barrier()
            start = time.perf_counter()
            work = dist.all_reduce(tensor, async_op=True)
            while not work.is_completed():
                operand = torch.tanh(operand @ operand * 1e-2)
            work.wait()
            times.append((time.perf_counter() - start) * 1e6)
        rows.append([nbytes, statistics.median(times)])
    return rows
