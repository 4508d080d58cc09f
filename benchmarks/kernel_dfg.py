"""Kernel-level local DFG of recorded GPU steps (graph/kernels.py): how well launches, stream order, syncs and
stream waits explain where the GPU ops started, and what faster kernels or CPU ops would buy.

    python benchmarks/kernel_dfg.py [TRACE ...]     (default: the recorded GPU DDP trace in ../shared/fixtures)

Per ProfilerStep: the measured step, its replay, the replayed GPU ops' start error against the measured starts
(median and p90 over the step's GPU ops), each stream's busy time, the step with every kernel x0.5 and with every
aten:: CPU op x0.5, and the replay's time.

Then the job level (graph/kernels.py job_kernel_dfg): the first trace and --copies - 1 copies of it as further ranks,
copy k's clock 12,345.6 x k us ahead (the recorded fixture holds one rank of its 2-GPU job, so the peers are
constructed): per step the offsets' largest error, the joined replay against the first trace alone, the GPU ops'
start error, and the what-if of the last rank's GPU x1.5 and x2 (the step, and rank 0's wait for it in the
collectives). Then the 2-rank GPU run dprorun recorded on an H200 (tests/data: resnet_small, gloo on CUDA tensors):
each profiled step's kernel-level global DFG on the run's own clock offsets, measured vs replayed step and the time
each rank waited for the other in the collectives. Last line: the largest median start error, the largest offset
error, and the recorded run's largest step error.
"""
import argparse
import os
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
DEFAULT = os.path.join(os.path.dirname(REPO), "shared", "fixtures", "kineto-gpu",
                       "nccl_parser_config_nccl_data.json.gz")
KERNELS = {"*Kernel*": 0.5, "*kernel*": 0.5, "*gemm*": 0.5, "*sm80*": 0.5, "*cutlass*": 0.5}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="*", default=[DEFAULT])
    parser.add_argument("--copies", type=int, default=2, help="ranks of the constructed job (default 2)")
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
    offset_error = job_level(args.traces[0], args.copies)
    recorded = recorded_run()
    print(f"largest median start error of the replayed GPU ops: {worst:.1f} us; job level: offsets within "
          f"{offset_error:.2f} us; recorded 2-GPU run: steps within {recorded:.1f} %")


def recorded_run() -> float:
    import json
    import subprocess
    import tarfile
    import tempfile

    archive = os.path.join(REPO, "tests", "data", "gpu_h200_resnet_small_np2_gloo.tgz")
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(archive) as handle:
            handle.extractall(tmp, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
        out = subprocess.run([sys.executable, "-m", "dprorun.offline_cli", "import-kineto", tmp, "--json"],
                             capture_output=True, text=True, check=True, cwd=REPO)
    doc = json.loads(out.stdout)
    print("\nrecorded 2-GPU run (tests/data, gloo on CUDA tensors), each step one kernel-level global DFG")
    print(f"{'step':>4s} {'measured ms':>11s} {'replayed ms':>11s} {'error %':>8s} {'r0 waited ms meas/repl':>22s} "
          f"{'r1 waited ms meas/repl':>22s} {'start err us':>12s}")
    worst = 0.0
    for row in doc["steps"]:
        error = 100 * (row["replayed_ms"] / row["measured_ms"] - 1)
        worst = max(worst, abs(error))
        waited = row["waited_in_collectives_ms"]
        print(f"{row['step']:4d} {row['measured_ms']:11.2f} {row['replayed_ms']:11.2f} {error:+8.1f} "
              f"{waited['measured'][0]:10.2f} / {waited['replayed'][0]:9.2f} "
              f"{waited['measured'][1]:10.2f} / {waited['replayed'][1]:9.2f} {max(row['gpu_start_error_us']):12.1f}")
    for reason in doc["skipped"]:
        print(f"skipped: {reason}")
    return worst


def job_level(path: str, copies: int) -> float:
    import gzip
    import json
    import tempfile

    from dprorun.graph.kernels import job_kernel_dfg, replay_job_step, replay_step
    from dprorun.trace.kineto import read_kineto

    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as handle:
        doc = json.load(handle)
    traces = [read_kineto(path)]
    shift = 12345.6
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(1, copies):
            copy = json.loads(json.dumps(doc))
            copy.setdefault("distributedInfo", {})["rank"] = k
            for event in copy["traceEvents"]:
                if "ts" in event:
                    event["ts"] += shift * k
            target = os.path.join(tmp, f"rank{k}.json")
            with open(target, "w") as handle:
                json.dump(copy, handle)
            traces.append(read_kineto(target))
    print(f"\njob level: {os.path.basename(path)} and {copies - 1} shifted copies as ranks 1-{copies - 1}")
    print(f"{'step':>4s} {'nodes':>7s} {'offset err us':>13s} {'joined ms':>10s} {'alone ms':>9s} "
          f"{'start err us':>12s} {'last x1.5 ms':>12s} {'r0 waits ms':>11s} {'last x2 ms':>10s} "
          f"{'r0 waits ms':>11s} {'replay s':>8s}")
    worst = 0.0
    last = copies - 1
    for step, _, _ in traces[0].steps:
        nodes = job_kernel_dfg(traces, step).graph.size
        t0 = time.perf_counter()
        joined = replay_job_step(traces, step)
        seconds = time.perf_counter() - t0
        error = max(abs(off + shift * k) for k, off in enumerate(joined.offsets_us))
        worst = max(worst, error)
        alone = replay_step(traces[0], step).replayed_us
        slow = replay_job_step(traces, step, rank_scale={last: 1.5})
        slower = replay_job_step(traces, step, rank_scale={last: 2.0})
        print(f"{step:4d} {nodes:7d} {error:13.2f} {joined.replayed_us / 1000:10.2f} {alone / 1000:9.2f} "
              f"{max(joined.start_error_us):12.1f} {slow.replayed_us / 1000:12.2f} "
              f"{slow.waited_replayed_us[0] / 1000:11.2f} {slower.replayed_us / 1000:10.2f} "
              f"{slower.waited_replayed_us[0] / 1000:11.2f} {seconds:8.3f}")
    return worst


def _matches(name: str, pattern: str) -> bool:
    from fnmatch import fnmatchcase

    return fnmatchcase(name.split(":", 1)[-1], pattern)


if __name__ == "__main__":
    main()
