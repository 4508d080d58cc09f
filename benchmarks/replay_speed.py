"""Replay speed on a synthetic 128-rank ResNet-50-shaped global DFG at op level (about 1M ops).

The job model has ResNet-50's 161 parameter tensors (25.6M parameters, fp32) with gradients ready in reverse
layer order, bucketed as DDP would at --bucket-mb, and an op-level profile (conv2d / batch_norm / relu per module
forward, the module's backward op and an AccumulateGrad per parameter, an add_ per parameter in the update);
the replay graph for --np ranks has, per rank, those ops cut at the buckets' ready points, and per bucket a
2(N-1)-step ring of SEND/RECV ops.

usage: python benchmarks/replay_speed.py [--np 128] [--bucket-mb 6] [--reps 5]
"""
import argparse
import statistics
import time


from dprorun.replay.engine import load_compiled, replay
from dprorun.replay.whatif import WhatIf
from dprorun.replay import comm as comm_module
from dprorun.replay.synthesize import synthesize
from dprorun.synth import resnet50_job_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--np", type=int, default=128)
    parser.add_argument("--bucket-mb", type=float, default=6.0)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--collapse", action="store_true",
                        help="collapse rings beyond 64 built ranks as predictions do (default: step-level rings, "
                             "so the graph has about 1M ops)")
    args = parser.parse_args()
    if not args.collapse:
        comm_module.COLLAPSE_FROM_RANKS = 1 << 30
    model = resnet50_job_model(args.np)
    started = time.perf_counter()
    # every rank built: the point is the engine's speed on a graph of this size (predictions fold the ring's
    # repeating ranks, here all alike, into one: see `synthesize`)
    graph = synthesize(model, WhatIf(world_size=args.np, bucket_mb=args.bucket_mb), [], fold=False)
    build_s = time.perf_counter() - started
    load_compiled()
    replay(graph)  # compile / load the compiled loop once
    times, result = [], None
    for _ in range(args.reps):
        result = replay(graph)
        times.append(result.replay_time_s)
    edges = len(graph.indices)
    compute = graph.stats()["compute_ops_per_rank"]
    print(f"{'ranks':>5} {'buckets':>7} {'compute ops/rank':>16} {'ops':>9} {'edges':>9} {'build s':>8} "
          f"{'replay s (median)':>17} {'iteration ms':>12} engine")
    print(f"{args.np:5d} {graph.meta['buckets']:7d} {compute:16.0f} {graph.size:9d} {edges:9d} {build_s:8.2f} "
          f"{statistics.median(times):17.3f} {result.iteration_time_us / 1000:12.1f} {result.engine}")
    print(f"replay of {graph.size} ops: {statistics.median(times):.3f} s (median of {args.reps})")


if __name__ == "__main__":
    main()
