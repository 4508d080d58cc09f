"""Clock-alignment solve time and accuracy on synthetic runs with known clock offsets.

A synthetic run (dprorun.synth) simulates ring all-reduce jobs on one true clock, then shifts each rank's
timestamps by a random offset in [-5, 5] ms and adds clock probes; `align` must recover the offsets.

usage: python benchmarks/align_speed.py [--worlds 4,8,16] [--iterations 10] [--buckets 4] [--seeds 3]
"""
import argparse
import statistics
import time

from dprorun.align import align
from dprorun.synth import synthetic_ring_run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="4,8,16")
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--buckets", type=int, default=4)
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    print(f"{'ranks':>5} {'iters':>5} {'recv ops':>8} {'solve s (median)':>16} {'max |error| us':>14} "
          f"{'violations before':>17} {'after':>5}")
    worst = 0.0
    for world in (int(w) for w in args.worlds.split(",")):
        times, errors, before, after = [], [], [], []
        for seed in range(args.seeds):
            run, truth = synthetic_ring_run(world=world, iterations=args.iterations, buckets=args.buckets,
                                            seed=seed)
            recvs = sum(1 for op in run.all_ops() if op.phase == "recv")
            started = time.perf_counter()
            result = align(run)
            times.append(time.perf_counter() - started)
            errors.append(max(abs(result.offsets_us[r] - truth[r]) for r in truth))
            before.append(result.violations_before)
            after.append(result.violations_after)
        worst = max(worst, statistics.median(times)) if world == 16 else worst
        print(f"{world:5d} {args.iterations:5d} {recvs:8d} {statistics.median(times):16.2f} {max(errors):14.2f} "
              f"{statistics.median(before):17.0f} {max(after):5d}", flush=True)
    print(f"median solve time for 16 ranks x {args.iterations} iterations: {worst:.2f} s")


if __name__ == "__main__":
    main()
