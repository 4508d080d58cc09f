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
    import torch
    import torch.distributed as dist

    from dprorun.runtime.backends import group_backend

    device = "cuda" if group_backend() == "nccl" and torch.cuda.is_available() else "cpu"

    def call(tensor) -> None:
        dist.all_reduce(tensor)
        if device == "cuda":
            torch.cuda.synchronize()

    return _timed_sizes(lambda nbytes, k: dist.barrier(), call, device, reps)


def _timed_sizes(line_up, call, device: str, reps: int, make=None) -> list[list[float]]:
    """For every calibration size: `reps` calls of `call(tensor)`, each after `line_up(nbytes, k)`, timed, with
    the CPU time the process's other threads (the transport) spent meanwhile: this process's CPU time minus the
    calling thread's. [[bytes, median µs, median transport CPU µs], ...]. The sizes take turns (round k calls
    every size once), so a stall of a few calls' length (a descheduled rank on a busy host) lands on several sizes
    once each, where the median discards it, not on all the calls of one size, where it bent the fitted line (a
    2-core CI host fitted a slope <= 0 and the cost model fell back). `make(count)` makes the float32 tensor
    of `count` zeros (a torch tensor on `device` unless given)."""
    import statistics

    if make is None:
        import torch

        def make(count: int):
            return torch.zeros(count, dtype=torch.float32, device=device)

    tensors = {nbytes: make(nbytes // 4) for nbytes in CALIBRATION_SIZES}
    times: dict[int, list[float]] = {nbytes: [] for nbytes in CALIBRATION_SIZES}
    transport_cpu: dict[int, list[float]] = {nbytes: [] for nbytes in CALIBRATION_SIZES}
    for k in range(reps):
        for nbytes, tensor in tensors.items():
            line_up(nbytes, k)
            start, process_cpu, thread_cpu = time.perf_counter(), time.process_time(), time.thread_time()
            call(tensor)
            times[nbytes].append((time.perf_counter() - start) * 1e6)
            others_cpu = (time.process_time() - process_cpu) - (time.thread_time() - thread_cpu)
            transport_cpu[nbytes].append(max(0.0, others_cpu) * 1e6)
    return [[nbytes, statistics.median(times[nbytes]), statistics.median(transport_cpu[nbytes])]
            for nbytes in CALIBRATION_SIZES]


def calibrate_horovod(session: RankSession, reps: int = 5) -> list[list[float]]:
    """Horovod jobs: timed `hvd.allreduce` calls of the calibration sizes, each after an all-reduce of one float
    that lines the ranks up, so each call is one response of its own (negotiation, the wait for the background
    loop's next cycle, the transport): [[bytes, median µs, median transport CPU µs], ...] as for
    torch.distributed jobs. The cost model takes Horovod's bandwidth and per-response latency from it; the
    timeline's fused responses, timed while the ranks compute, include waiting for the other rank."""
    import torch

    hvd = sys.modules["horovod.torch"]

    def line_up(nbytes: int, k: int) -> None:
        hvd.allreduce(torch.zeros(1), name=f"dprorun.calibration.barrier.{nbytes}.{k}")

    def call(tensor) -> None:
        hvd.allreduce(tensor, name=f"dprorun.calibration.{tensor.numel() * 4}", op=hvd.Sum)

    return _timed_sizes(line_up, call, "cpu", reps)


DTYPE_CALIBRATION_BYTES = 1 << 22
HOROVOD_WIRE_DTYPES = ("float16", "float64")  # besides float32, the floating dtypes Horovod all-reduces on gloo


def horovod_wire_dtypes(buckets: dict) -> list[str]:
    """The dtypes other than float32 a Horovod job's gradients are sent in (session.records.buckets: a gradient's
    own dtype, or float16 under hvd.Compression.fp16: half its bytes sent)."""
    sent = set()
    for entry in buckets.values():
        compressed = entry.get("buffer_nbytes") and 2 * int(entry["nbytes"]) == int(entry["buffer_nbytes"])
        sent.add("float16" if compressed else entry.get("dtype", ""))
    return sorted(sent & set(HOROVOD_WIRE_DTYPES))


def calibrate_horovod_dtypes(dtypes: list[str], reps: int = 5) -> list[list]:
    """For each dtype: `reps` timed hvd.allreduce calls of DTYPE_CALIBRATION_BYTES in it and as many of float32,
    taking turns, each after a one-float all-reduce that lines the ranks up: [[dtype, bytes, median µs, float32
    median µs], ...]. gloo sums float16 in software: a float16 response took 1.28 x a float32 one of its bytes at
    1 Gbit/s, which the float32 calibration cannot see (replay/build._horovod_dtype_costs)."""
    import statistics

    import torch

    hvd = sys.modules["horovod.torch"]
    rows = []
    for dtype in dtypes:
        tensors = {name: torch.zeros(DTYPE_CALIBRATION_BYTES // torch.tensor([], dtype=getattr(torch, name))
                                     .element_size(), dtype=getattr(torch, name)) for name in (dtype, "float32")}
        times: dict[str, list[float]] = {name: [] for name in tensors}
        for k in range(reps):
            for name, tensor in tensors.items():
                hvd.allreduce(torch.zeros(1), name=f"dprorun.calibration.dtype.barrier.{dtype}.{name}.{k}")
                start = time.perf_counter()
                hvd.allreduce(tensor, name=f"dprorun.calibration.dtype.{dtype}.{name}", op=hvd.Sum)
                times[name].append((time.perf_counter() - start) * 1e6)
        rows.append([dtype, DTYPE_CALIBRATION_BYTES, statistics.median(times[dtype]),
                     statistics.median(times["float32"])])
    return rows


def calibrate_under_compute(session: RankSession, reps: int = 5) -> list[list[float]]:
    """The same all-reduces while every rank computes (a CPU transport only; the GPU's are not on the cores):
    each rank starts one asynchronously and runs small matrix products until it completes, as a backward does
    around the collectives it overlaps. [[bytes, median µs], ...]: what a collective costs when its threads
    must wait for cores the computation holds (the replay's contention model, replay/template.py)."""
    import statistics

    import torch
    import torch.distributed as dist

    from dprorun.runtime.backends import group_backend

    if group_backend() == "nccl":
        return []
    operand = torch.full((128, 128), 0.5)  # no draw from the script's generator
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
