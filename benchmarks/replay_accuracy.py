"""Replay accuracy: predicted iteration time (from a profiled run) vs the measured time of an unprofiled run.

For each example x DDP bucket size x network, --reps times, interleaved (medians reported):
  measured   plain `torchrun` (the example prints the median iteration time of its second half)
  profiled   `dprorun` with a long window, then `dpro replay --json` (dPRO replay) and `--baseline daydream`;
             the same run's `clean` iterations after the window (no profiling, same processes) are a second
             reference without the run-to-run variance of separate launches (several % on this 2-core machine)
Networks: loopback, and a 1 Gbit/s tbf-shaped loopback inside a fresh network namespace
(scripts/with-netns-1gbit; needs root, skipped otherwise).

usage: python benchmarks/replay_accuracy.py [--examples ...] [--buckets 1,25] [--nets loopback,1gbit]
       [--script-args "--accumulate 2"] [--compare-with DIR]
--script-args go to every launch of the examples (torchrun's and dprorun's); --compare-with DIR also replays each
profiled run with the dprorun of another checkout (its column: the "other" error against the same run's clean
iterations).
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
STEPS = {"mlp_many_layers": 80, "resnet_small": 64, "transformer_small": 48, "embedding_adam": 64, "hf_trainer": 40}


def wrap(net: str, cmd: list[str]) -> list[str]:
    return [NETNS, "--"] + cmd if net == "1gbit" else cmd


def measured_ms(example: str, bucket_mb: float, net: str, steps: int, script_args: tuple[str, ...] = ()) -> float:
    cmd = wrap(net, [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                     os.path.join(REPO, "examples", f"{example}.py"), "--steps", str(steps),
                     "--bucket-mb", str(bucket_mb), *script_args])
    for attempt in (1, 2):  # a plain torchrun launch on this VM fails now and then (rendezvous); retry once
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=900,
                             env=dict(os.environ, GLOO_SOCKET_IFNAME="lo"))
        if out.returncode == 0:
            return float(re.search(r"median iteration time: ([0-9.]+) ms", out.stdout).group(1))
        print(f"note: torchrun failed (rc {out.returncode}, attempt {attempt}): {out.stderr.strip()[-600:]}",
              file=sys.stderr)
    raise SystemExit("torchrun failed twice")


def profiled(example: str, bucket_mb: float, net: str, steps: int, whatifs: list[list[str]],
             script_args: tuple[str, ...] = (), compare_with: str | None = None) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = os.path.join(tmp, "run")
        # the window covers the same part of the run as the torchrun measurement (its second half): on this VM
        # the first ~30 iterations of a job are slower while allocator and gloo settle
        warmup, clean = steps // 2, max(5, steps // 8)
        active = steps - warmup - clean - 2
        cmd = wrap(net, [sys.executable, "-m", "dprorun.cli", "-np", "2", "--run-dir", run_dir, "-q",
                         "--warmup", str(warmup), "--active", str(active), "--kineto-iters", "3", "--clean", str(clean),
                         "python", os.path.join(REPO, "examples", f"{example}.py"), "--steps", str(steps),
                         "--bucket-mb", str(bucket_mb), *script_args])
        subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=REPO, timeout=900,
                       env=dict(os.environ, GLOO_SOCKET_IFNAME="lo"))
        with open(os.path.join(run_dir, "summary.json")) as handle:
            clean_ms = json.load(handle)["clean_iteration_time_ms"]
        out = []
        for extra in whatifs:
            res = subprocess.run([sys.executable, "-m", "dprorun.offline_cli", "replay", run_dir, "--json", *extra],
                                 capture_output=True, text=True, check=True, cwd=REPO, timeout=600)
            doc = json.loads(res.stdout)
            doc["clean_ms"] = clean_ms
            if compare_with and not extra:  # the same run replayed by another checkout's dprorun
                other = subprocess.run([sys.executable, "-m", "dprorun.offline_cli", "replay", run_dir, "--json"],
                                       capture_output=True, text=True, check=True, cwd=compare_with, timeout=600)
                doc["other_ms"] = json.loads(other.stdout)["predicted_iteration_time_ms"]
            out.append(doc)
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", default="mlp_many_layers,resnet_small,transformer_small,embedding_adam")
    parser.add_argument("--buckets", default="1,25")
    parser.add_argument("--nets", default="loopback,1gbit")
    parser.add_argument("--reps", type=int, default=3, help="interleaved measured/profiled pairs per config")
    parser.add_argument("--script-args", default="", help="extra arguments of every example launch")
    parser.add_argument("--compare-with", help="a checkout of another dprorun: its replay of the same runs too")
    parser.add_argument("--steps-scale", type=float, default=1.0,
                        help="multiply every example's step count (longer runs: more iterations per median)")
    args = parser.parse_args()
    nets = args.nets.split(",")
    script_args = tuple(args.script_args.split())
    if "1gbit" in nets and os.geteuid() != 0:
        print("note: not root, the 1 Gbit network namespace is skipped")
        nets = [n for n in nets if n != "1gbit"]
    print(f"{'example':18} {'bucket':>6} {'net':8} {'torchrun':>9} {'dPRO':>8} {'err':>7} {'clean':>8} "
          f"{'err':>7} {'Daydream':>9} {'err':>7} {'err/clean':>9} {'spread':>7}")
    errors, dd_errors, clean_errors, dd_clean_errors = [], [], [], []
    for example in args.examples.split(","):
        for bucket in (float(b) for b in args.buckets.split(",")):
            for net in nets:
                steps = int(STEPS.get(example, 40) * args.steps_scale)
                truths, preds, dds, cleans, others = [], [], [], [], []
                for _ in range(args.reps):
                    truths.append(measured_ms(example, bucket, net, steps, script_args))
                    dpro, daydream = profiled(example, bucket, net, steps, [[], ["--baseline", "daydream"]],
                                              script_args, args.compare_with)
                    preds.append(dpro["predicted_iteration_time_ms"])
                    if "other_ms" in dpro:
                        others.append(dpro["other_ms"])
                    dds.append(daydream["predicted_iteration_time_ms"])
                    cleans.append(dpro["clean_ms"])
                truth, pred, dd = statistics.median(truths), statistics.median(preds), statistics.median(dds)
                clean = statistics.median(cleans)
                clean_err, dd_clean_err = 100 * (pred / clean - 1), 100 * (dd / clean - 1)
                clean_errors.append(abs(clean_err))
                dd_clean_errors.append(abs(dd_clean_err))
                err, dd_err = 100 * (pred / truth - 1), 100 * (dd / truth - 1)
                errors.append(abs(err))
                dd_errors.append(abs(dd_err))
                # spread: how far apart this row's torchrun launches were (max - min, % of their median)
                spread = 100 * (max(truths) - min(truths)) / truth
                other = (f" other {statistics.median(others):8.2f} "
                         f"{100 * (statistics.median(others) / clean - 1):+6.1f}% vs clean" if others else "")
                print(f"{example:18} {bucket:6g} {net:8} {truth:9.2f} {pred:8.2f} {err:+6.1f}% {clean:8.2f} "
                      f"{clean_err:+6.1f}% {dd:9.2f} {dd_err:+6.1f}% {dd_clean_err:+8.1f}% {spread:6.1f}%{other}",
                      flush=True)
    print(f"vs torchrun runs: dPRO |error| median {statistics.median(errors):.1f} %, max {max(errors):.1f} %; "
          f"Daydream median {statistics.median(dd_errors):.1f} %, max {max(dd_errors):.1f} %")
    print(f"vs the same run's unprofiled iterations: dPRO |error| median {statistics.median(clean_errors):.1f} %, "
          f"max {max(clean_errors):.1f} %; Daydream median {statistics.median(dd_clean_errors):.1f} %, "
          f"max {max(dd_clean_errors):.1f} %")


if __name__ == "__main__":
    main()
