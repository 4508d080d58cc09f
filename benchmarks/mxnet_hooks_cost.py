"""The hooks' cost on a parameter-server job: the example's own median iteration (worker 0, second half of its
steps), launched plainly and under `dprorun --backend mxnet` (hooks on; the profiling window in the first half, the
clean iterations after it), interleaved rounds, medians.

usage: python benchmarks/mxnet_hooks_cost.py [--models handloop,mlp] [--reps 4] [--net loopback|1gbit] [--omp N]
       [--compare-with CHECKOUT]
Each profile of this checkout is also replayed as run (`dpro replay`): the replay's median against the plain one.
With --compare-with, each round also runs the job under that checkout's dprorun (its hooks: e.g. a git worktree of
an earlier commit), the order alternated from round to round: a before/after of the hooks' cost.
Last line: per model, the median under dprorun against the plain median (and the other checkout's).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mxnet_replay_accuracy import MODELS, REPO, STEPS, example, plain_ms, wrap  # noqa: E402


def under_dprorun_ms(model: str, checkout: str = REPO, net: str = "loopback") -> tuple[float, float]:
    """Worker 0's own printed median iteration when the job runs under dprorun (2 workers, 2 servers), the dprorun
    of `checkout`, and the profile replayed as run by that checkout (ms)."""
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = os.path.join(tmp, "run")
        env = dict(os.environ, PYTHONPATH=checkout)
        done = subprocess.run(wrap(net, [sys.executable, "-m", "dprorun.cli", "--backend", "mxnet", "-np", "2",
                                         "--servers", "2", "--run-dir", run_dir, "-q", "--warmup", "10", "--active",
                                         "20", "--clean", str(STEPS - 40), "python", example(model), "--steps",
                                         str(STEPS), *MODELS[model]]),
                              capture_output=True, text=True, cwd=checkout, timeout=600, env=env)
        found = re.findall(r"worker 0 of 2: median iteration ([0-9.]+) ms", done.stdout + done.stderr)
        if not found or (done.returncode != 0 and checkout == REPO):
            raise SystemExit(f"dprorun failed: {done.stderr[-2000:]}")
        replay = subprocess.run([sys.executable, "-m", "dprorun.offline_cli", "replay", run_dir, "--json"],
                                capture_output=True, text=True, cwd=checkout, env=env)
        if replay.returncode != 0 and checkout == REPO:
            raise SystemExit(f"dpro replay failed: {replay.stderr[-2000:]}")
        # another checkout's may profile nothing (e.g. one made to launch without its hooks): no replay then
        replayed = json.loads(replay.stdout)["predicted_iteration_ms"] if replay.returncode == 0 else None
    return float(found[0]), replayed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="handloop,mlp")
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--compare-with", default=None, metavar="CHECKOUT",
                        help="also run the job under this checkout's dprorun in every round")
    parser.add_argument("--net", default="loopback", choices=("loopback", "1gbit"))
    parser.add_argument("--omp", type=int, default=None, metavar="N",
                        help="OMP_NUM_THREADS=N for every role of every launch (as mxnet_replay_accuracy.py --omp)")
    args = parser.parse_args()
    if args.omp:
        os.environ["OMP_NUM_THREADS"] = str(args.omp)
    other = os.path.abspath(args.compare_with) if args.compare_with else None
    rows = []
    for model in args.models.split(","):
        runs: dict[str, list[float]] = {"plain": [], "this": [], "other": [], "replay": [], "other replay": []}
        for rep in range(args.reps):  # interleaved; plain and each checkout alternate who goes first
            order = [("plain", None), ("this", REPO)] + ([("other", other)] if other else [])
            for name, checkout in (order if rep % 2 == 0 else order[::-1]):
                if checkout is None:
                    runs["plain"].append(plain_ms(model, 2, args.net))
                    continue
                own, replayed = under_dprorun_ms(model, checkout, args.net)
                runs[name].append(own)
                if replayed is not None:
                    runs["replay" if name == "this" else "other replay"].append(replayed)
        rows.append((model, runs))
    print(f"{'model':9} {'run':18} {'ms (rounds)':>34} {'median':>8} {'vs plain':>9}")
    for model, runs in rows:
        base = statistics.median(runs["plain"])
        for name, label in (("plain", "plain"), ("this", "under dprorun"), ("replay", "its replay"),
                            ("other", "other checkout"), ("other replay", "other's replay")):
            if runs[name]:
                median = statistics.median(runs[name])
                print(f"{model:9} {label:18} {' / '.join(f'{x:.1f}' for x in runs[name]):>34} {median:8.2f} "
                      f"{100 * (median / base - 1):+8.1f}%")
    print(f"({args.net}) hooks' cost: " + ", ".join(
        f"{model} {100 * (statistics.median(r['this']) / statistics.median(r['plain']) - 1):+.1f} %"
        + (f" (other checkout {100 * (statistics.median(r['other']) / statistics.median(r['plain']) - 1):+.1f} %)"
           if r["other"] else "")
        + f"; replay {100 * (statistics.median(r['replay']) / statistics.median(r['plain']) - 1):+.1f} %"
        for model, r in rows))


if __name__ == "__main__":
    main()
