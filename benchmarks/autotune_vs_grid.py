"""Autotune vs an exhaustive grid of real runs, on a comm-bound job (2 ranks, 1 Gbit/s tbf namespace).

  default   the example with DDP's default buckets (torchrun)
  grid      torchrun at every bucket cap of --caps, --reps launches each: the best cap is the reference
  autotune  `dprorun --autotune` (profile window, search, trial window, never-regress decision, final run);
            its final run's iteration time is measured by the example itself, as for the other rows
Also: the strategy's predicted iteration time vs its measured trial (the optimizer's accuracy, issue 5), and the
time each approach took (the grid: all its runs; autotune: until its decision, and in all).

usage: sudo python benchmarks/autotune_vs_grid.py [--example mlp_many_layers] [--batch-size 512] [--reps 2]
Last line: autotune's speed-up over the default and its share of the best grid point.
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
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NETNS = os.path.join(REPO, "scripts", "with-netns-1gbit")


def _median_ms(stdout: str) -> float:
    return float(re.search(r"median iteration time: ([0-9.]+) ms", stdout).group(1))


def torchrun_ms(args, cap: float | None) -> float:
    cmd = [NETNS, "--", sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           os.path.join(REPO, "examples", f"{args.example}.py"), "--steps", str(args.steps),
           "--batch-size", str(args.batch_size)] + (["--bucket-mb", str(cap)] if cap is not None else [])
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=REPO, timeout=900)
    return _median_ms(out.stdout)


def autotune(args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = os.path.join(tmp, "run")
        cmd = [NETNS, "--", sys.executable, "-m", "dprorun.cli", "-np", "2", "--autotune", "-q", *args.autotune_flags,
               "--run-dir", run_dir, "--warmup", str(args.warmup), "--active", str(args.active), "--clean", "2", "python",
               os.path.join(REPO, "examples", f"{args.example}.py"), "--steps", str(args.steps),
               "--batch-size", str(args.batch_size)]
        started = time.monotonic()
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=REPO, timeout=1800)
        total_s = time.monotonic() - started
        with open(os.path.join(run_dir, "autotune.json")) as handle:
            phases = {p["phase"]: p for p in json.load(handle)["phases"]}
        with open(os.path.join(run_dir, "strategy.json")) as handle:
            strategy = json.load(handle)
    return {"final_ms": _median_ms(out.stdout), "total_s": total_s,
            "decision_s": phases["deciding"].get("tuning_seconds"), "keep": phases["deciding"]["keep"],
            "profile_ms": phases["profiling"]["measured_ms"], "trial_ms": phases.get("trial", {}).get("measured_ms"),
            "predicted_ms": strategy.get("predicted_ms"),
            "choice": "; ".join(d["choice"] for d in strategy.get("decisions", [])) or "none"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--example", default="mlp_many_layers")
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--active", type=int, default=16)
    parser.add_argument("--caps", default="0.25,0.5,1,2,5,10,25")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--autotune-flag", dest="autotune_flags", action="append", default=[],
                        help="extra dprorun flag for the autotune runs, e.g. --autotune-flag=--allow-bf16")
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("needs root for the network namespace (scripts/with-netns-1gbit)")
    caps = [float(c) for c in args.caps.split(",")]
    grid: dict = {c: [] for c in caps}
    default, tuned = [], []
    grid_s = 0.0
    for rep in range(args.reps):  # interleaved: default, grid, autotune in each round
        default.append(torchrun_ms(args, None))
        started = time.monotonic()
        for cap in caps:
            grid[cap].append(torchrun_ms(args, cap))
        grid_s += time.monotonic() - started
        tuned.append(autotune(args))
        print(f"round {rep + 1}: default {default[-1]:.1f} ms, grid "
              + ", ".join(f"{c:g}:{grid[c][-1]:.1f}" for c in caps)
              + f", autotune {tuned[-1]['final_ms']:.1f} ms ({tuned[-1]['choice']}, keep={tuned[-1]['keep']})",
              flush=True)
    med = {c: statistics.median(v) for c, v in grid.items()}
    best_cap = min(med, key=med.get)
    default_ms = statistics.median(default)
    tuned_ms = statistics.median(t["final_ms"] for t in tuned)
    print(f"\n{'approach':28} {'iteration ms':>12} {'vs default':>10} {'time s':>8}")
    print(f"{'DDP default buckets':28} {default_ms:12.2f} {0:+9.1f}% {'-':>8}")
    for cap in caps:
        print(f"{'grid: ' + format(cap, 'g') + ' MB':28} {med[cap]:12.2f} {100 * (1 - med[cap] / default_ms):+9.1f}%")
    print(f"{'grid total (best ' + format(best_cap, 'g') + ' MB)':28} {med[best_cap]:12.2f} "
          f"{100 * (1 - med[best_cap] / default_ms):+9.1f}% {grid_s / args.reps:8.1f}")
    decision_s = statistics.median(t["decision_s"] for t in tuned)
    total_s = statistics.median(t["total_s"] for t in tuned)
    print(f"{'autotune (final run)':28} {tuned_ms:12.2f} {100 * (1 - tuned_ms / default_ms):+9.1f}% "
          f"{decision_s:8.1f}  (to decide; {total_s:.1f} s with the final run)")
    for t in tuned:
        if t["trial_ms"] and t["predicted_ms"]:
            print(f"  strategy {t['choice']}: predicted {t['predicted_ms']:.2f} ms, trial measured "
                  f"{t['trial_ms']:.2f} ms ({100 * (t['predicted_ms'] / t['trial_ms'] - 1):+.1f} %), profile "
                  f"{t['profile_ms']:.2f} ms, final {t['final_ms']:.2f} ms")
    print(f"autotune speed-up over DDP default: {100 * (1 - tuned_ms / default_ms):.1f} %; share of the best grid "
          f"point ({best_cap:g} MB): {100 * med[best_cap] / tuned_ms:.1f} %")


if __name__ == "__main__":
    main()
