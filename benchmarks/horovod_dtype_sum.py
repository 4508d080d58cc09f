"""Horovod's all-reduce of 4 MiB in float16 against float32, idle and beside compute (a thread of matrix products on
each rank): gloo sums float16 in software, on the cores the compute wants.

usage: OMP_NUM_THREADS=1 horovodrun -np 2 --gloo python benchmarks/horovod_dtype_sum.py
       (at 1 Gbit/s: scripts/with-netns-1gbit -- horovodrun ...)
Rank 0 prints a table (median ms of 5 calls each) and a last line with the two float16 / float32 ratios.
"""
import statistics
import threading
import time

import horovod.torch as hvd
import torch

BYTES = 1 << 22


def compute(stop: threading.Event) -> None:
    matrix = torch.randn(256, 256)
    while not stop.is_set():
        matrix @ matrix


def timed_ms(dtype: torch.dtype, busy: bool, reps: int = 5) -> float:
    tensor = torch.zeros(BYTES // torch.tensor([], dtype=dtype).element_size(), dtype=dtype)
    times = []
    for k in range(reps):
        hvd.allreduce(torch.zeros(1), name=f"line-up.{dtype}.{busy}.{k}")
        stop = threading.Event()
        thread = threading.Thread(target=compute, args=(stop,)) if busy else None
        if thread is not None:
            thread.start()
        start = time.perf_counter()
        hvd.allreduce(tensor, name=f"call.{dtype}.{busy}", op=hvd.Sum)
        times.append((time.perf_counter() - start) * 1e3)
        stop.set()
        if thread is not None:
            thread.join()
    return statistics.median(times)


def main() -> None:
    hvd.init()
    torch.set_num_threads(1)
    ratios = {}
    rows = []
    for busy in (False, True):
        ms = {dtype: timed_ms(dtype, busy) for dtype in (torch.float32, torch.float16)}
        ratios[busy] = ms[torch.float16] / ms[torch.float32]
        rows.append(f"| {'beside compute' if busy else 'idle'} | {ms[torch.float32]:.1f} | {ms[torch.float16]:.1f} | "
                    f"{ratios[busy]:.2f} |")
    if hvd.rank() == 0:
        print("| condition | float32 ms | float16 ms | ratio |\n|---|---|---|---|")
        print("\n".join(rows))
        print(f"float16 / float32 for {BYTES >> 20} MiB: idle {ratios[False]:.2f}, beside compute {ratios[True]:.2f}")


if __name__ == "__main__":
    main()
