"""Replay accuracy: predicted iteration time (from a profiled run) vs the measured time of an unprofiled run.

For each example x DDP bucket size x network, --reps times, interleaved (medians reported):
  measured   plain `torchrun` (the example prints the median iteration time of its second half)
  profiled   `dprorun` with a long window, then `dpro replay --json` (dPRO replay) and `--baseline daydream`
Networks: loopback, and a 1 Gbit/s tbf-shaped loopback inside a fresh network namespace
(scripts/with-netns-1gbit; needs root, skipped otherwise).

usage: python benchmarks/replay_accuracy.py [--examples ...] [--buckets 1,25] [--nets loopback,1gbit]
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
STEPS = {"mlp_many_layers": 60, "resnet_small": 50, "transformer_small": 40}


def wrap(net: str, cmd: list[str]) -> list[str]:
    return [NETNS, "--"] + cmd if net == "1gbit" else cmd


def measured_ms(example: str, bucket_mb: float, net: str, steps: int) -> float:
    cmd = wrap(net, [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                     os.path.join(REPO, "examples", f"{example}.py"), "--steps", str(steps),
                     "--bucket-mb", str(bucket_mb)])
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=REPO, timeout=900,
                         env=dict(os.environ, GLOO_SOCKET_IFNAME="lo"))
    return float(re.search(r"median iteration time: ([0-9.]+) ms", out.stdout).group(1))


def profiled(example: str, bucket_mb: float, net: str, steps: int, whatifs: list[list[str]]) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = os.path.join(tmp, "run")
        warmup = steps // 4
        active = steps - warmup - 4
        cmd = wrap(net, [sys.executable, "-m", "dprorun.cli", "-np", "2", "--run-dir", run_dir, "-q",
                         "--warmup", str(warmup), "--active", str(active), "--kineto-iters", "3", "--clean", "2",
                         "python", os.path.join(REPO, "examples", f"{example}.py"), "--steps", str(steps),
                         "--bucket-mb", str(bucket_mb)])
        subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=REPO, timeout=900,
                       env=dict(os.environ, GLOO_SOCKET_IFNAME="lo"))
        out = []
        for extra in whatifs:
            res = subprocess.run([sys.executable, "-m", "dprorun.offline_cli", "replay", run_dir, "--json", *extra],
                                 capture_output=True, text=True, check=True, cwd=REPO, timeout=600)
            out.append(json.loads(res.stdout))
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", default="mlp_many_layers,resnet_small,transformer_small")
    parser.add_argument("--buckets", default="1,25")
    parser.add_argument("--nets", default="loopback,1gbit")
    parser.add_argument("--reps", type=int, default=3, help="interleaved measured/profiled pairs per config")
    args = parser.parse_args()
    nets = args.nets.split(",")
    if "1gbit" in nets and os.geteuid() != 0:
        print("note: not root, the 1 Gbit network namespace is skipped")
        nets = [n for n in nets if n != "1gbit"]
    print(f"{'example':18} {'bucket':>6} {'net':8} {'measured':>9} {'dPRO':>8} {'err':>7} {'in-run':>8} "
          f"{'Daydream':>9} {'err':>7}")
    errors, dd_errors = [], []
    for example in args.examples.split(","):
        for bucket in (float(b) for b in args.buckets.split(",")):
            for net in nets:
                steps = STEPS.get(example, 40)
                truths, preds, dds, in_run = [], [], [], []
                for _ in range(args.reps):
                    truths.append(measured_ms(example, bucket, net, steps))
                    dpro, daydream = profiled(example, bucket, net, steps, [[], ["--baseline", "daydream"]])
                    preds.append(dpro["predicted_iteration_time_ms"])
                    dds.append(daydream["predicted_iteration_time_ms"])
                    in_run.append(dpro["measured_iteration_time_ms"])
                truth, pred, dd = statistics.median(truths), statistics.median(preds), statistics.median(dds)
                err, dd_err = 100 * (pred / truth - 1), 100 * (dd / truth - 1)
                errors.append(abs(err))
                dd_errors.append(abs(dd_err))
                print(f"{example:18} {bucket:6g} {net:8} {truth:9.2f} {pred:8.2f} {err:+6.1f}% "
                      f"{statistics.median(in_run):8.2f} {dd:9.2f} {dd_err:+6.1f}%", flush=True)
    print(f"dPRO replay |error|: median {statistics.median(errors):.1f} %, max {max(errors):.1f} %; "
          f"Daydream baseline: median {statistics.median(dd_errors):.1f} %, max {max(dd_errors):.1f} %")


if __name__ == "__main__":
    main()
