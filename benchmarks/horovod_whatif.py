"""Horovod fusion what-if: profile a Horovod job at its default knobs, predict other fusion thresholds and cycle
times with `dpro replay --horovod-fusion-mb T --horovod-cycle-ms C`, and measure each with plain `horovodrun
--fusion-threshold-mb T --cycle-time-ms C`, interleaved --reps times (medians).

usage: OMP_NUM_THREADS=1 [sudo] python benchmarks/horovod_whatif.py [--nets loopback,1gbit] [--reps 3]
       [--model mlp|transformer|resnet] [--batch-size 32]
(OMP_NUM_THREADS=1 as in benchmarks/horovod_replay_accuracy.py; 1gbit needs root for its network namespace.)
Columns: measured and predicted ms, error, and the change against the default knobs, measured and predicted
(each side against its own default row). Last line: median and max |error| over the what-if rows.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile

from horovod_replay_accuracy import EXAMPLE, REPO, common_parser, measured_ms, usable_nets, wrap

SETTINGS = [(None, None), (4.0, 5.0), (1.0, 1.0), (0.0, None), (64.0, 10.0)]  # (fusion MB, cycle ms); None: default


def label(fusion, cycle) -> str:
    if fusion is None:
        return "defaults (as run)"
    return f"{fusion:g} MB" + (f" / {cycle:g} ms" if cycle is not None else "")


def knob_args(fusion, cycle, prefix: str) -> list[str]:
    out = []
    if fusion is not None:
        out += [f"--{prefix}fusion{'-threshold' if not prefix else ''}-mb", f"{fusion:g}"]
    if cycle is not None:
        out += [f"--{prefix}cycle{'-time' if not prefix else ''}-ms", f"{cycle:g}"]
    return out


def predictions(net: str, steps: int, batch: int, model: str) -> list[float]:
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = os.path.join(tmp, "run")
        subprocess.run(wrap(net, [sys.executable, "-m", "dprorun.cli", "--backend", "horovod", "-np", "2", "-q",
                                  "--run-dir", run_dir, "python", EXAMPLE, "--steps", str(steps), "--batch-size",
                                  str(batch), "--model", model]), capture_output=True, text=True, check=True,
                       timeout=900, cwd=REPO,
                       env=dict(os.environ, DPRO_REPORT="0"))
        out = []
        for fusion, cycle in SETTINGS:
            res = subprocess.run([sys.executable, "-m", "dprorun.offline_cli", "replay", run_dir, "--json",
                                  *knob_args(fusion, cycle, "horovod-")],
                                 capture_output=True, text=True, check=True, timeout=600, cwd=REPO)
            out.append(json.loads(res.stdout)["predicted_iteration_time_ms"])
        return out


def main() -> None:
    parser = common_parser(__doc__)
    args = parser.parse_args()
    nets = usable_nets(args.nets)
    print("| network | knobs | measured ms | predicted ms | error | change measured | change predicted |")
    print("|---|---|---|---|---|---|---|")
    errors = []
    for net in nets:
        measured = [[] for _ in SETTINGS]
        predicted = [[] for _ in SETTINGS]
        for _ in range(args.reps):
            for k, p in enumerate(predictions(net, args.steps, args.batch_size, args.model)):
                predicted[k].append(p)
            for k, (fusion, cycle) in enumerate(SETTINGS):
                measured[k].append(measured_ms(net, args.steps, args.batch_size, tuple(knob_args(fusion, cycle, "")),
                                               args.model))
        m = [statistics.median(v) for v in measured]
        p = [statistics.median(v) for v in predicted]
        for k, (fusion, cycle) in enumerate(SETTINGS):
            err = 100 * (p[k] / m[k] - 1)
            if k:
                errors.append(abs(err))
            change = "" if not k else f"{100 * (m[k] / m[0] - 1):+.1f} % | {100 * (p[k] / p[0] - 1):+.1f} %"
            print(f"| {net} | {label(fusion, cycle)} | {m[k]:.2f} | {p[k]:.2f} | {err:+.1f} % | "
                  + (change if change else " | ") + " |", flush=True)
    print(f"Horovod fusion what-if |error| vs horovodrun: median {statistics.median(errors):.1f} %, "
          f"max {max(errors):.1f} % over {len(errors)} rows")


if __name__ == "__main__":
    main()
