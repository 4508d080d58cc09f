"""The hooks' cost on a parameter-server job: the example's own median iteration (worker 0, second half of its
steps), launched plainly and under `dprorun --backend mxnet` (hooks on; the profiling window in the first half, the
clean iterations after it), interleaved rounds, medians.

usage: python benchmarks/mxnet_hooks_cost.py [--models handloop,mlp] [--reps 4] [--compare-with CHECKOUT]
With --compare-with, each round also runs the job under that checkout's dprorun (its hooks: e.g. a git worktree of
an earlier commit), the order alternated from round to round: a before/after of the hooks' cost.
Last line: per model, the median under dprorun against the plain median (and the other checkout's).
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


def under_dprorun_ms(model: str, checkout: str = REPO) -> float:
    """Worker 0's own printed median iteration when the job runs under dprorun (2 workers, 2 servers), the dprorun
    of `checkout`."""
    with tempfile.TemporaryDirectory() as tmp:
        done = subprocess.run([sys.executable, "-m", "dprorun.cli", "--backend", "mxnet", "-np", "2", "--servers", "2",
                               "--run-dir", os.path.join(tmp, "run"), "-q", "--warmup", "10", "--active", "20",
                               "--clean", str(STEPS - 40), "python", example(model), "--steps", str(STEPS),
                               *MODELS[model]], capture_output=True, text=True, cwd=checkout, timeout=600,
                              env=dict(os.environ, PYTHONPATH=checkout))
    found = re.findall(r"worker 0 of 2: median iteration ([0-9.]+) ms", done.stdout + done.stderr)
    if done.returncode != 0 or not found:
        raise SystemExit(f"dprorun failed: {done.stderr[-2000:]}")
    return float(found[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="handloop,mlp")
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--compare-with", default=None, metavar="CHECKOUT",
                        help="also run the job under this checkout's dprorun in every round")
    args = parser.parse_args()
    other = os.path.abspath(args.compare_with) if args.compare_with else None
    rows = []
    for model in args.models.split(","):
        runs: dict[str, list[float]] = {"plain": [], "this": [], "other": []}
        for rep in range(args.reps):  # interleaved; this checkout and the other alternate who goes first
            runs["plain"].append(plain_ms(model, 2, "loopback"))
            order = [("this", REPO)] + ([("other", other)] if other else [])
            for name, checkout in (order if rep % 2 == 0 else order[::-1]):
                runs[name].append(under_dprorun_ms(model, checkout))
        rows.append((model, runs))
    print(f"{'model':9} {'run':18} {'ms (rounds)':>34} {'median':>8} {'vs plain':>9}")
    for model, runs in rows:
        base = statistics.median(runs["plain"])
        for name, label in (("plain", "plain"), ("this", "under dprorun"), ("other", "other checkout")):
            if runs[name]:
                median = statistics.median(runs[name])
                print(f"{model:9} {label:18} {' / '.join(f'{x:.1f}' for x in runs[name]):>34} {median:8.2f} "
                      f"{100 * (median / base - 1):+8.1f}%")
    print("hooks' cost: " + ", ".join(
        f"{model} {100 * (statistics.median(r['this']) / statistics.median(r['plain']) - 1):+.1f} %"
        + (f" (other checkout {100 * (statistics.median(r['other']) / statistics.median(r['plain']) - 1):+.1f} %)"
           if r["other"] else "") for model, r in rows))


if __name__ == "__main__":
    main()
