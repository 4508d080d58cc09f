"""Kernel-level local DFG of recorded GPU steps (graph/kernels.py): how well launches, stream order, syncs and
stream waits explain where the GPU ops started, and what faster kernels or CPU ops would buy.

    python benchmarks/kernel_dfg.py [TRACE ...]     (default: the recorded GPU DDP trace in ../shared/fixtures)

Per ProfilerStep: the measured step, its replay, the replayed GPU ops' start error against the measured starts
(median and p90 over the step's GPU ops), each stream's busy time, the step with every kernel x0.5 and with every
aten:: CPU op x0.5, and the replay's time. Last line: the largest median start error.
"""
import argparse
import os
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT = os.path.join(os.path.dirname(REPO), "shared", "fixtures", "kineto-gpu",
                       "nccl_parser_config_nccl_data.json.gz")
KERNELS = {"*Kernel*": 0.5, "*kernel*": 0.5, "*gemm*": 0.5, "*sm80*": 0.5, "*cutlass*": 0.5}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="*", default=[DEFAULT])
    args = parser.parse_args()
    from dprorun.graph.kernels import activity_of_step, kernel_dfg, replay_step
    from dprorun.replay.engine import replay
    from dprorun.trace.kineto import read_kineto

    worst = 0.0
    print(f"{'trace':28s} {'step':>4s} {'measured ms':>11s} {'replayed ms':>11s} {'start err us med/p90':>20s} "
          f"{'GPU busy ms':>18s} {'kernels x0.5':>12s} {'aten x0.5':>10s} {'replay s':>8s}")
    for path in args.traces:
        if not os.path.exists(path):
            sys.exit(f"{path}: not found (the recorded GPU traces are in ../shared/fixtures)")
        trace = read_kineto(path)
        for step, a, b in trace.steps:
            dfg = kernel_dfg(activity_of_step(trace, step))
            t0 = time.perf_counter()
            result = replay(dfg.graph)
            seconds = time.perf_counter() - t0
            errors = np.array([abs(result.start_us[n] - t) for n, t in dfg.measured_start_us.items()] or [0.0])
            busy = "/".join(f"{us / 1000:.1f}" for d, us in result.device_busy_us.items() if ".cuda:" in d)
            kernels = replay_step(trace, step, {k: v for k, v in KERNELS.items()
                                                if any(_matches(n, k) for n in dfg.graph.names)}).replayed_us
            cpu = replay_step(trace, step, {"aten::*": 0.5}).replayed_us
            median = float(np.median(errors))
            worst = max(worst, median)
            print(f"{os.path.basename(path)[:28]:28s} {step:4d} {(b - a) / 1000:11.2f} "
                  f"{result.iteration_time_us / 1000:11.2f} {median:9.1f} / {np.percentile(errors, 90):8.1f} "
                  f"{busy:>18s} {kernels / 1000:12.2f} {cpu / 1000:10.2f} {seconds:8.3f}")
    print(f"largest median start error of the replayed GPU ops: {worst:.1f} us")


def _matches(name: str, pattern: str) -> bool:
    from fnmatch import fnmatchcase

    return fnmatchcase(name.split(":", 1)[-1], pattern)


if __name__ == "__main__":
    main()
