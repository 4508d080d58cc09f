"""The optimizer's predicted gain vs real runs, on a comm-bound job (2 ranks, 1 Gbit/s tbf namespace).

Per round, interleaved:
  profile   `dprorun` at DDP's default buckets (profiling window), then `dpro optimize` on it: the strategy,
            its predicted iteration time and the modelled default it was compared with
  default   plain torchrun at DDP's default buckets (measured by the example itself)
  strategy  `dprorun --strategy strategy.json` with no profiling window (the hooks apply the strategy's buckets
            and partitions, nothing is recorded), measured by the example itself
  by hand   when the strategy is only a DDP bucket cap: plain torchrun with the example's `--bucket-mb CAP`
            (no dprorun hook in the process at all; the issue's "applying the bucket parts by hand")
Per round and as medians: predicted vs measured iteration time under the strategy, and predicted gain (vs the
modelled default) vs measured gain (vs the measured default).

usage: sudo python benchmarks/optimizer_accuracy.py [--example mlp_many_layers] [--batch-size 1024] [--reps 5]
Last line: median |error| of the strategy's predicted iteration time, and predicted vs measured gain (points).
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

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NETNS = os.path.join(REPO, "scripts", "with-netns-1gbit")


def _median_ms(stdout: str) -> float:
    return float(re.search(r"median iteration time: ([0-9.]+) ms", stdout).group(1))


def _example(args) -> list[str]:
    return [os.path.join(REPO, "examples", f"{args.example}.py"), "--steps", str(args.steps),
            "--batch-size", str(args.batch_size)]


def torchrun_default_ms(args) -> float:
    cmd = [NETNS, "--", sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    out = subprocess.run(cmd + _example(args), capture_output=True, text=True, check=True, cwd=REPO, timeout=900)
    return _median_ms(out.stdout)


def profile_and_optimize(args, tmp: str) -> tuple[dict, float]:
    """The strategy (dpro optimize's JSON) from a profiled default run, and that run's own iteration time."""
    run_dir = os.path.join(tmp, "profile")
    cmd = [NETNS, "--", sys.executable, "-m", "dprorun.cli", "-np", "2", "-q", "--run-dir", run_dir,
           "--warmup", str(args.warmup), "--active", str(args.active), "--clean", "2", "python"] + _example(args)
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=REPO, timeout=900,
                         env=dict(os.environ, DPRO_REPORT="0"))
    own = _median_ms(out.stdout + out.stderr)
    strategy_file = os.path.join(tmp, "strategy.json")
    subprocess.run([sys.executable, "-m", "dprorun.offline_cli", "optimize", run_dir, "-o", strategy_file],
                   capture_output=True, text=True, check=True, cwd=REPO, timeout=600)
    with open(strategy_file) as f:
        return json.load(f), own


def strategy_ms(args, strategy_file: str, tmp: str) -> float:
    cmd = [NETNS, "--", sys.executable, "-m", "dprorun.cli", "-np", "2", "-q", "--run-dir",
           os.path.join(tmp, "strategy_run"), "--warmup", "1000000", "--strategy", strategy_file, "python"] \
        + _example(args)
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=REPO, timeout=900,
                         env=dict(os.environ, DPRO_REPORT="0"))
    return _median_ms(out.stdout + out.stderr)


def by_hand_cap(strategy: dict):
    """The DDP bucket cap when that is all the strategy changes (then plain torchrun can apply it), else None."""
    plain = (not strategy.get("partitions") and not strategy.get("recompute_segments")
             and strategy.get("accumulation_steps", 1) == 1 and strategy.get("precision", "fp32") == "fp32"
             and not strategy.get("compiled_modules"))
    return strategy.get("bucket_cap_mb") if plain else None


def torchrun_cap_ms(args, cap_mb: float) -> float:
    cmd = [NETNS, "--", sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    out = subprocess.run(cmd + _example(args) + ["--bucket-mb", str(cap_mb)], capture_output=True, text=True,
                         check=True, cwd=REPO, timeout=900)
    return _median_ms(out.stdout)


def describe(strategy: dict) -> str:
    parts = [d["choice"] for d in strategy.get("decisions", [])]
    return "; ".join(parts) or "no change"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--example", default="mlp_many_layers")
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--active", type=int, default=24)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("needs root: the 1 Gbit/s link is a tbf qdisc in a network namespace")
    print(f"{'round':>5} {'default ms':>10} {'modelled':>9} {'strategy ms':>11} {'predicted':>9} {'error':>7} "
          f"{'gain meas':>9} {'gain pred':>9} {'by hand':>8} {'error':>7} {'gain':>6}  strategy")
    rows = []
    for k in range(args.reps):
        with tempfile.TemporaryDirectory() as tmp:
            strategy, own = profile_and_optimize(args, tmp)
            default = torchrun_default_ms(args)
            path = os.path.join(tmp, "strategy.json")
            measured = strategy_ms(args, path, tmp)
            cap = by_hand_cap(strategy)
            hand = torchrun_cap_ms(args, cap) if cap is not None else float("nan")
        predicted, modelled = strategy["predicted_ms"], strategy["baseline_ms"]
        row = {"default": default, "modelled": modelled, "measured": measured, "predicted": predicted,
               "error": 100 * (predicted / measured - 1), "gain_measured": 100 * (1 - measured / default),
               "gain_predicted": 100 * (1 - predicted / modelled), "profiled_own": own,
               "hand": hand, "hand_error": 100 * (predicted / hand - 1), "gain_hand": 100 * (1 - hand / default)}
        rows.append(row)
        print(f"{k:5d} {default:10.2f} {modelled:9.2f} {measured:11.2f} {predicted:9.2f} {row['error']:+6.1f}% "
              f"{row['gain_measured']:8.1f}% {row['gain_predicted']:8.1f}% {hand:8.2f} {row['hand_error']:+6.1f}% "
              f"{row['gain_hand']:5.1f}%  {describe(strategy)}", flush=True)
    med = {key: statistics.median([r[key] for r in rows if r[key] == r[key]] or [float("nan")]) for key in rows[0]}
    print(f"{'median':>5} {med['default']:10.2f} {med['modelled']:9.2f} {med['measured']:11.2f} "
          f"{med['predicted']:9.2f} {100 * (med['predicted'] / med['measured'] - 1):+6.1f}% "
          f"{med['gain_measured']:8.1f}% {med['gain_predicted']:8.1f}% {med['hand']:8.2f} "
          f"{100 * (med['predicted'] / med['hand'] - 1):+6.1f}% {med['gain_hand']:5.1f}%")
    if all(r["hand"] == r["hand"] for r in rows):  # every round's strategy was a plain bucket cap
        print(f"by hand (torchrun --bucket-mb): measured {med['hand']:.2f} ms, predicted "
              f"{100 * (med['predicted'] / med['hand'] - 1):+.1f} %, gain measured {med['gain_hand']:.1f} %")
    print(f"strategy: median predicted {med['predicted']:.2f} ms vs measured {med['measured']:.2f} ms "
          f"({100 * (med['predicted'] / med['measured'] - 1):+.1f} %); gain predicted {med['gain_predicted']:.1f} % "
          f"vs measured {med['gain_measured']:.1f} % ({med['gain_predicted'] - med['gain_measured']:+.1f} points)")


if __name__ == "__main__":
    main()
