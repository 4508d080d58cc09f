"""Profiling overhead: iteration time inside dprorun's active window vs the same script under plain torchrun.

For each example, REPS rounds; each round runs, back to back, (a) `torchrun --standalone` (the example prints the
median iteration time of its second half) and (b) `dprorun` with the window placed in the same part of the run
(the summary's median over the window's iterations under the hooks alone, over the `clean` iterations that
follow the window with no profiling, and over the few iterations with torch.profiler on). Reported: medians
over the rounds and their ratios.

usage: python benchmarks/overhead.py [--reps 5] [--np 2] [--steps 40] [--examples mlp_many_layers,...]
[--script-args "..."] [--compare-args "--no-kineto"]
(--compare-args: a second dprorun configuration launched in the same rounds, its order alternating, on a row of its own)
(an entry of --examples ending in .py is a script's path from the repository root, e.g. benchmarks/shapes/x.py)
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
EXAMPLES = ("mlp_many_layers", "resnet_small", "transformer_small")


def script_path(example: str) -> str:
    return os.path.join(REPO, example) if example.endswith(".py") else os.path.join(REPO, "examples", f"{example}.py")


def plain_torchrun(example: str, nproc: int, steps: int, script_args: tuple = ()) -> float:
    for attempt in range(3):  # torch's gloo teardown aborts a rank now and then at exit ("terminate called without an
        # active exception"), after its timings were printed: launched again
        out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                              f"--nproc-per-node={nproc}", script_path(example), "--steps", str(steps), *script_args],
                             capture_output=True, text=True, cwd=REPO, timeout=600)
        if out.returncode == 0:
            break
        if "terminate called without an active exception" in out.stderr and "median iteration time" in out.stdout:
            break  # a shape whose every plain launch aborts so (ranks of unequal work): its timings were printed
    else:
        raise RuntimeError(f"torchrun failed 3 times: {out.stderr[-1000:]}")
    match = re.search(r"median iteration time: ([0-9.]+) ms", out.stdout)
    if not match:
        raise RuntimeError(f"no timing in torchrun output: {out.stdout[-500:]}")
    return float(match.group(1))


def under_dprorun(example: str, nproc: int, steps: int, extra: list[str],
                  script_args: tuple = ()) -> tuple[float, float, float]:
    half = steps // 2
    active = max(1, steps // 4)
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = os.path.join(tmp, "run")
        subprocess.run([sys.executable, "-m", "dprorun.cli", "-np", str(nproc), "--run-dir", run_dir, "-q",
                        "--warmup", str(half), "--active", str(active), "--clean", str(steps - half - active - 1),
                        *extra, "python", script_path(example), "--steps", str(steps), *script_args],
                       capture_output=True, text=True, check=True, cwd=REPO, timeout=600)
        from dprorun.summary import summarize_run

        summary = summarize_run(run_dir)
        return (summary["iteration_time_ms"], summary["clean_iteration_time_ms"],
                summary["kineto_iteration_time_ms"] or float("nan"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--examples", default=",".join(EXAMPLES))
    parser.add_argument("--dprorun-args", default="", help="extra dprorun flags, e.g. '--no-kineto'")
    parser.add_argument("--script-args", default="", help="the script's own flags, e.g. '--model conv --adam'")
    parser.add_argument("--compare-args", default=None,
                        help="a second set of dprorun flags launched in the same rounds (a row of its own, '+ FLAGS')")
    args = parser.parse_args()
    configs = [args.dprorun_args.split()]
    if args.compare_args is not None:
        configs.append(args.compare_args.split())
    rows = []
    print(f"{'example':20} {'torchrun ms':>12} {'window ms':>10} {'clean ms':>9} {'window/torchrun':>16} "
          f"{'window/clean':>13} {'profiler-on ms':>14} {'profiler/torchrun':>17}")
    for example in args.examples.split(","):
        plain = []
        measured = [([], [], []) for _ in configs]  # per config: window, clean, profiler-on
        for rep in range(args.reps):
            plain.append(plain_torchrun(example, args.np, args.steps, tuple(args.script_args.split())))
            order = list(enumerate(configs)) if rep % 2 == 0 else list(enumerate(configs))[::-1]
            for index, extra in order:
                for column, value in zip(measured[index], under_dprorun(example, args.np, args.steps, extra,
                                                                        tuple(args.script_args.split()))):
                    column.append(value)
        p = statistics.median(plain)
        for extra, (window, clean, kineto) in zip(configs, measured):
            w, c, k = statistics.median(window), statistics.median(clean), statistics.median(kineto)
            label = example if extra is configs[0] else f"+ {' '.join(extra) or '(defaults)'}"
            rows.append({"example": example, "dprorun_args": extra, "torchrun_ms": p, "window_ms": w, "clean_ms": c,
                         "raw": {"torchrun": plain, "window": window, "clean": clean}})
            print(f"{label:20} {p:12.2f} {w:10.2f} {c:9.2f} {100 * (w / p - 1):+15.1f}% {100 * (w / c - 1):+12.1f}% "
                  f"{k:14.2f} {100 * (k / p - 1):+16.1f}%", flush=True)
    with open(os.path.join(tempfile.gettempdir(), "dprorun_overhead.json"), "w") as handle:
        json.dump(rows, handle, indent=1)
    overall = statistics.median(r["window_ms"] / r["torchrun_ms"] for r in rows if r["dprorun_args"] == configs[0])
    print(f"median overhead of the active window vs plain torchrun: {100 * (overall - 1):+.1f} %")


if __name__ == "__main__":
    main()
