"""Horovod fusion what-if: profile a Horovod job at its default knobs, predict other fusion thresholds and cycle
times with `dpro replay --horovod-fusion-mb T --horovod-cycle-ms C`, and measure each with plain `horovodrun
--fusion-threshold-mb T --cycle-time-ms C`, interleaved --reps times (medians).

usage: OMP_NUM_THREADS=1 [sudo] python benchmarks/horovod_whatif.py [--nets loopback,1gbit] [--reps 3]
       [--model mlp|transformer|resnet|mixed] [--batch-size 32] [--settings 64/10,4/5] [--compare-with CHECKOUT]
(OMP_NUM_THREADS=1 as in benchmarks/horovod_replay_accuracy.py; 1gbit needs root for its network namespace.)
Columns: measured and predicted ms, error, and the change against the default knobs, measured and predicted
(each side against its own default row). Last line: median and max |error| over the what-if rows.
--settings: the what-ifs as "fusion MB/cycle ms" pairs (default: those of SETTINGS); --compare-with CHECKOUT: the
dprorun of another checkout (a git worktree of an older commit) replays the same profiles too, its predictions in a
last column (its replay alone: the profile, hooks and calibration, is this checkout's).
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


def predictions(net: str, steps: int, batch: int, model: str, settings: list,
                checkouts: tuple[str, ...] = (REPO,)) -> list[list[float]]:
    """One profile by this checkout's dprorun, replayed at every setting by each of `checkouts`: per checkout, the
    predicted ms per setting."""
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = os.path.join(tmp, "run")
        subprocess.run(wrap(net, [sys.executable, "-m", "dprorun.cli", "--backend", "horovod", "-np", "2", "-q",
                                  "--run-dir", run_dir, "python", EXAMPLE, "--steps", str(steps), "--batch-size",
                                  str(batch), "--model", model]), capture_output=True, text=True, check=True,
                       timeout=900, cwd=REPO,
                       env=dict(os.environ, DPRO_REPORT="0"))
        out = []
        for checkout in checkouts:
            out.append([])
            for fusion, cycle in settings:
                res = subprocess.run([sys.executable, "-m", "dprorun.offline_cli", "replay", run_dir, "--json",
                                      *knob_args(fusion, cycle, "horovod-")], capture_output=True, text=True,
                                     check=True, timeout=600, cwd=checkout, env=dict(os.environ, PYTHONPATH=checkout))
                out[-1].append(json.loads(res.stdout)["predicted_iteration_time_ms"])
        return out


def parse_settings(spec: str) -> list:
    """"64/10,4/5" -> the default knobs, then (64.0, 10.0), (4.0, 5.0)."""
    if not spec:
        return SETTINGS
    return [(None, None)] + [tuple(float(x) for x in pair.split("/")) for pair in spec.split(",")]


def main() -> None:
    parser = common_parser(__doc__)
    parser.add_argument("--settings", default="", help='what-if knobs, "fusion MB/cycle ms" pairs: 64/10,4/5')
    parser.add_argument("--compare-with", help="another checkout whose dprorun replays the same profiles")
    args = parser.parse_args()
    nets = usable_nets(args.nets)
    settings = parse_settings(args.settings)
    checkouts = (REPO,) + ((os.path.abspath(args.compare_with),) if args.compare_with else ())
    print("| network | knobs | measured ms | predicted ms | error | change measured | change predicted |"
          + (" other checkout: predicted ms, error |" if args.compare_with else ""))
    print("|---|---|---|---|---|---|---|" + ("---|" if args.compare_with else ""))
    errors = []
    for net in nets:
        measured = [[] for _ in settings]
        predicted = [[[] for _ in settings] for _ in checkouts]
        for _ in range(args.reps):
            for c, row in enumerate(predictions(net, args.steps, args.batch_size, args.model, settings, checkouts)):
                for k, p in enumerate(row):
                    predicted[c][k].append(p)
            for k, (fusion, cycle) in enumerate(settings):
                measured[k].append(measured_ms(net, args.steps, args.batch_size, tuple(knob_args(fusion, cycle, "")),
                                               args.model))
        m = [statistics.median(v) for v in measured]
        p = [statistics.median(v) for v in predicted[0]]
        for k, (fusion, cycle) in enumerate(settings):
            err = 100 * (p[k] / m[k] - 1)
            if k:
                errors.append(abs(err))
            change = "" if not k else f"{100 * (m[k] / m[0] - 1):+.1f} % | {100 * (p[k] / p[0] - 1):+.1f} %"
            other = ""
            if args.compare_with:
                o = statistics.median(predicted[1][k])
                other = f" {o:.2f}, {100 * (o / m[k] - 1):+.1f} % |"
            print(f"| {net} | {label(fusion, cycle)} | {m[k]:.2f} | {p[k]:.2f} | {err:+.1f} % | "
                  + (change if change else " | ") + " |" + other, flush=True)
    print(f"Horovod fusion what-if |error| vs horovodrun: median {statistics.median(errors):.1f} %, "
          f"max {max(errors):.1f} % over {len(errors)} rows")


if __name__ == "__main__":
    main()
