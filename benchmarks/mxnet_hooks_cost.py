"""The hooks' cost on a parameter-server job: the example's own median iteration (worker 0, second half of its
steps), launched plainly and under `dprorun --backend mxnet` (hooks on; the profiling window in the first half, the
clean iterations after it), interleaved rounds, medians.

usage: python benchmarks/mxnet_hooks_cost.py [--models handloop,mlp] [--reps 4]
Last line: per model, the median under dprorun against the plain median.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mxnet_replay_accuracy import MODELS, REPO, STEPS, example, plain_ms  # noqa: E402


def under_dprorun_ms(model: str) -> float:
    """Worker 0's own printed median iteration when the job runs under dprorun (2 workers, 2 servers)."""
    with tempfile.TemporaryDirectory() as tmp:
        done = subprocess.run([sys.executable, "-m", "dprorun.cli", "--backend", "mxnet", "-np", "2", "--servers", "2",
                               "--run-dir", os.path.join(tmp, "run"), "-q", "--warmup", "10", "--active", "20",
                               "--clean", str(STEPS - 40), "python", example(model), "--steps", str(STEPS),
                               *MODELS[model]], capture_output=True, text=True, cwd=REPO, timeout=600)
    found = re.findall(r"worker 0 of 2: median iteration ([0-9.]+) ms", done.stdout + done.stderr)
    if done.returncode != 0 or not found:
        raise SystemExit(f"dprorun failed: {done.stderr[-2000:]}")
    return float(found[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="handloop,mlp")
    parser.add_argument("--reps", type=int, default=4)
    args = parser.parse_args()
    rows = []
    for model in args.models.split(","):
        plain, hooked = [], []
        for _ in range(args.reps):  # interleaved
            plain.append(plain_ms(model, 2, "loopback"))
            hooked.append(under_dprorun_ms(model))
        rows.append((model, plain, hooked))
    print(f"{'model':9} {'plain ms (rounds)':>34} {'median':>8} {'under dprorun ms (rounds)':>34} {'median':>8} "
          f"{'cost %':>7}")
    for model, plain, hooked in rows:
        p, h = statistics.median(plain), statistics.median(hooked)
        print(f"{model:9} {' / '.join(f'{x:.1f}' for x in plain):>34} {p:8.2f} "
              f"{' / '.join(f'{x:.1f}' for x in hooked):>34} {h:8.2f} {100 * (h / p - 1):+7.1f}")
    print("hooks' cost: " + ", ".join(f"{model} {100 * (statistics.median(h) / statistics.median(p) - 1):+.1f} %"
                                      for model, p, h in rows))


if __name__ == "__main__":
    main()
