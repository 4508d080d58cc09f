"""Replay speed on a synthetic 128-rank ResNet-50-shaped global DFG (about 1M ops).

The job model has ResNet-50's 161 parameter tensors (25.6M parameters, fp32) with gradients ready in reverse
layer order, bucketed as DDP would at --bucket-mb; the replay graph for --np ranks has, per rank, forward,
backward segments, update, and per bucket a 2(N-1)-step ring of SEND/RECV ops.

usage: python benchmarks/replay_speed.py [--np 128] [--bucket-mb 6] [--reps 5]
"""
import argparse
import statistics
import time


from dprorun.replay.engine import ENGINE, replay
from dprorun.replay.template import BucketInfo, CommModel, JobModel, RankTemplate
from dprorun.replay.whatif import WhatIf, synthesize


def resnet50_params() -> dict[str, int]:
    """161 tensors of ResNet-50 (conv weights, batch-norm weight/bias, fc), sizes in bytes (fp32)."""
    sizes = {"conv1.weight": 64 * 3 * 7 * 7, "bn1.weight": 64, "bn1.bias": 64}
    cin = 64
    for stage, (blocks, width) in enumerate(((3, 64), (4, 128), (6, 256), (3, 512))):
        for b in range(blocks):
            prefix = f"layer{stage + 1}.{b}"
            shapes = [(width, cin, 1), (width, width, 3), (4 * width, width, 1)]
            for k, (cout, ci, ks) in enumerate(shapes, start=1):
                sizes[f"{prefix}.conv{k}.weight"] = cout * ci * ks * ks
                sizes[f"{prefix}.bn{k}.weight"] = cout
                sizes[f"{prefix}.bn{k}.bias"] = cout
            if b == 0:
                sizes[f"{prefix}.downsample.0.weight"] = 4 * width * cin
                sizes[f"{prefix}.downsample.1.weight"] = 4 * width
                sizes[f"{prefix}.downsample.1.bias"] = 4 * width
            cin = 4 * width
    sizes["fc.weight"], sizes["fc.bias"] = 1000 * 2048, 1000
    return {name: 4 * n for name, n in sizes.items()}


def job_model(world: int) -> JobModel:
    params = resnet50_params()
    names = list(params)
    fractions = {name: 1.0 - (k + 1) / len(names) for k, name in enumerate(names)}  # last layer ready first
    template = RankTemplate(rank=0, forward_us=30000, loss_us=200, backward_segments_us=[60000],
                            bucket_ready_order=[], update_us=5000, tail_us=2000, enqueue_cost_us=50,
                            backward_us=60000, iterations_used=10, measured_iteration_us=0)
    comm = CommModel(alpha_us=20.0, bandwidth_bytes_per_us=1250.0, source="synthetic 10 Gbit/s")
    return JobModel(world, {0: template}, [BucketInfo("bucket0", sum(params.values()), names, 0.0)], params,
                    fractions, comm, 25.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--np", type=int, default=128)
    parser.add_argument("--bucket-mb", type=float, default=6.0)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    model = job_model(args.np)
    started = time.perf_counter()
    graph = synthesize(model, WhatIf(world_size=args.np, bucket_mb=args.bucket_mb), [])
    build_s = time.perf_counter() - started
    replay(graph)  # compile / load the compiled loop once
    times, result = [], None
    for _ in range(args.reps):
        result = replay(graph)
        times.append(result.replay_time_s)
    edges = len(graph.indices)
    print(f"{'ranks':>5} {'buckets':>7} {'ops':>9} {'edges':>9} {'build s':>8} {'replay s (median)':>17} "
          f"{'iteration ms':>12} engine")
    print(f"{args.np:5d} {graph.meta['buckets']:7d} {graph.size:9d} {edges:9d} {build_s:8.2f} "
          f"{statistics.median(times):17.3f} {result.iteration_time_us / 1000:12.1f} {ENGINE}")
    print(f"replay of {graph.size} ops: {statistics.median(times):.3f} s (median of {args.reps})")


if __name__ == "__main__":
    main()
