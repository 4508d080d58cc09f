"""The op-level global DFG against the coarsened view it replaced: same predictions, more detail, its cost.

For each example (a fresh 2-rank profile under dprorun, or run directories given with --run-dirs) and each
what-if (the job as it ran, 1 MB and 25 MB buckets, 2 partitions, 4 and 8 ranks, 1 Gbit/s, accumulation,
re-computation): the prediction replayed on the coarsened view (one op per compute phase: the replay graph
before the op-level change, identical in structure) and on the op-level graph, their difference, the ops of
each, and the time per prediction; then the per-op what-if on the example's largest op type (x0.5) and the
critical path's top op. Last line: the largest |op-level - coarsened| over every row.

usage: python benchmarks/op_level_replay.py [--examples mlp_many_layers,resnet_small,transformer_small,embedding_adam]
       python benchmarks/op_level_replay.py --run-dirs RUN [RUN ...]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = {"mlp_many_layers": 40, "resnet_small": 32, "transformer_small": 32, "embedding_adam": 40, "hf_trainer": 32}


def profile(example: str, run_dir: str) -> None:
    cmd = [sys.executable, "-m", "dprorun.cli", "-np", "2", "--run-dir", run_dir, "-q", "python",
           os.path.join(REPO, "examples", f"{example}.py"), "--steps", str(STEPS.get(example, 40))]
    subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=REPO, timeout=900,
                   env=dict(os.environ, GLOO_SOCKET_IFNAME="lo"))


def compare(label: str, run_dir: str) -> list[float]:
    from collections import Counter

    from dprorun.analysis import RunAnalysis
    from dprorun.replay.predict import predict
    from dprorun.replay.whatif import WhatIf

    model = RunAnalysis(run_dir).model
    whatifs = {"as run": WhatIf(), "1 MB buckets": WhatIf(bucket_mb=1), "25 MB buckets": WhatIf(bucket_mb=25),
               "2 partitions": WhatIf(partitions=2), "4 ranks": WhatIf(world_size=4), "8 ranks": WhatIf(world_size=8),
               "1 Gbit/s": WhatIf(bandwidth_gbit=1), "accumulate 2": WhatIf(accumulation_steps=2),
               "recompute 2": WhatIf(recompute_segments=2)}
    ops = Counter(op.name for p in model.op_profiles.values() for phase in p.phases.values() for op in phase.ops
                  if op.name != "(between ops)")
    if ops:
        whatifs[f"{ops.most_common(1)[0][0]} x0.5"] = WhatIf(op_scale={ops.most_common(1)[0][0]: 0.5})
    diffs = []
    print(f"\n{label}: {sum(p.op_count for p in model.op_profiles.values()) // max(1, len(model.op_profiles))} "
          f"profiled ops per rank; scaling {model.op_scaling}")
    print(f"{'what-if':28} {'coarsened ms':>12} {'op level ms':>11} {'diff %':>8} {'ops (coarse/op)':>16} "
          f"{'s per prediction (coarse/op)':>28}  top op on the critical path")
    for name, whatif in whatifs.items():
        started = time.perf_counter()
        coarse = predict(model, whatif, detail="coarse")
        middle = time.perf_counter()
        full = predict(model, whatif, detail="ops")
        ended = time.perf_counter()
        diff = 100 * (full.predicted_iteration_time_ms / coarse.predicted_iteration_time_ms - 1)
        diffs.append(abs(diff))
        top = full.critical_path["top"][0]["op"] if full.critical_path["top"] else "-"
        print(f"{name:28} {coarse.predicted_iteration_time_ms:12.3f} {full.predicted_iteration_time_ms:11.3f} "
              f"{diff:+8.4f} {coarse.replay_ops:7d}/{full.replay_ops:<8d} "
              f"{middle - started:13.3f}/{ended - middle:<14.3f}  {top}")
    return diffs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", default="mlp_many_layers,resnet_small,transformer_small,embedding_adam")
    parser.add_argument("--run-dirs", nargs="*", default=None)
    args = parser.parse_args()
    diffs: list[float] = []
    if args.run_dirs:
        for run_dir in args.run_dirs:
            diffs += compare(run_dir, run_dir)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            for example in args.examples.split(","):
                run_dir = os.path.join(tmp, example)
                profile(example, run_dir)
                diffs += compare(example, run_dir)
    print(f"\nlargest |op level - coarsened| over {len(diffs)} predictions: {max(diffs):.4f} %")


if __name__ == "__main__":
    main()
