"""dprorun --autotune --backend horovod vs horovodrun --autotune (Horovod's Bayesian optimisation of fusion
threshold and cycle time), side by side on a 1 Gbit/s namespace: time to tune and the iteration time reached.

Per round, interleaved (examples/horovod_mlp.py, 2 ranks, OMP_NUM_THREADS=1):
  default    plain horovodrun, Horovod's default knobs; median of the second half of --steps
  horovod    horovodrun --autotune --autotune-log-file LOG with --tune-steps steps; the iteration time reached
             is the median of the last --report-last steps; time to tune = the log's last write - job start
  dprorun    dprorun --autotune --backend horovod (profile window, replay-ranked knob candidates, real trial
             windows, never-regress, final run); time to tune = its decision time (autotune.json), iteration
             time = the final run's second half
Medians over --reps rounds.

usage: sudo python benchmarks/horovod_autotune.py [--reps 2] [--batch-size 32]
"""
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
EXAMPLE = os.path.join(REPO, "examples", "horovod_mlp.py")


def _median_ms(stdout: str) -> float:
    return float(re.search(r"median iteration time: ([0-9.]+) ms", stdout).group(1))


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([NETNS, "--", *cmd], capture_output=True, text=True, cwd=REPO, timeout=1800, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"{cmd[:4]}: exit {out.returncode}: {out.stderr[-2000:]}")
    return out


def default(args) -> float:
    return _median_ms(_run(["horovodrun", "-np", "2", "--gloo", sys.executable, EXAMPLE, "--steps", str(args.steps),
                            "--batch-size", str(args.batch_size)]).stdout)


def horovod_autotune(args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "autotune.csv")
        started = time.time()
        out = _run(["horovodrun", "-np", "2", "--gloo", "--autotune", "--autotune-log-file", log, sys.executable,
                    EXAMPLE, "--steps", str(args.tune_steps), "--batch-size", str(args.batch_size),
                    "--report-last", str(args.report_last)])
        total = time.time() - started
        rows = open(log).read().strip().splitlines() if os.path.exists(log) else []
        tuned_s = os.path.getmtime(log) - started if rows else float("nan")
        best = rows[-1] if rows else ""
    return {"ms": _median_ms(out.stdout), "tune_s": tuned_s, "total_s": total, "samples": max(0, len(rows) - 1),
            "last": best}


def dprorun_autotune(args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = os.path.join(tmp, "run")
        started = time.time()
        out = _run([sys.executable, "-m", "dprorun.cli", "--backend", "horovod", "--autotune", "-np", "2", "-q",
                    "--run-dir", run_dir, "python", EXAMPLE, "--steps", str(args.steps), "--batch-size",
                    str(args.batch_size)])
        total = time.time() - started
        with open(os.path.join(run_dir, "autotune.json")) as handle:
            phases = json.load(handle)["phases"]
        deciding = next(p for p in phases if p["phase"] == "deciding")
        kept = deciding.get("strategy")
        choice = "own settings"
        if kept:
            with open(os.path.join(run_dir, "strategy.json")) as handle:
                doc = json.load(handle)
            choice = f"{doc['horovod_fusion_threshold_mb']:g} MB / {doc['horovod_cycle_time_ms']:g} ms"
        trials = [round(p["measured_ms"], 2) for p in phases if p["phase"] == "trial" and p.get("measured_ms")]
        profile = next(p for p in phases if p["phase"] == "profiling" and "measured_ms" in p)["measured_ms"]
    return {"ms": _median_ms(out.stdout), "tune_s": deciding["tuning_seconds"], "total_s": total, "choice": choice,
            "trials": trials, "profile_ms": profile}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--tune-steps", type=int, default=400, help="horovodrun --autotune job length")
    parser.add_argument("--report-last", type=int, default=100)
    args = parser.parse_args()
    rows = {"default": [], "horovod": [], "dprorun": []}
    for rnd in range(args.reps):
        rows["default"].append(default(args))
        rows["horovod"].append(horovod_autotune(args))
        rows["dprorun"].append(dprorun_autotune(args))
        h, d = rows["horovod"][-1], rows["dprorun"][-1]
        print(f"round {rnd + 1}: default {rows['default'][-1]:.2f} ms; horovodrun --autotune {h['ms']:.2f} ms, "
              f"tuned in {h['tune_s']:.1f} s ({h['samples']} samples; last: {h['last']}); dprorun {d['ms']:.2f} ms, "
              f"decided in {d['tune_s']:.1f} s ({d['choice']}; profile {d['profile_ms']:.2f}, trials {d['trials']})",
              flush=True)
    base = statistics.median(rows["default"])
    print()
    print(f"{'approach':28} {'iteration ms':>12} {'vs default':>10} {'time to tune s':>14} {'job wall s':>10}")
    print(f"{'horovodrun (defaults)':28} {base:12.2f} {0:+9.1f}% {'-':>14} {'-':>10}")
    for key, label in (("horovod", "horovodrun --autotune"), ("dprorun", "dprorun --autotune")):
        ms = statistics.median(r["ms"] for r in rows[key])
        tune = statistics.median(r["tune_s"] for r in rows[key])
        wall = statistics.median(r["total_s"] for r in rows[key])
        print(f"{label:28} {ms:12.2f} {100 * (1 - ms / base):+9.1f}% {tune:14.1f} {wall:10.1f}")
    h = statistics.median(r["ms"] for r in rows["horovod"])
    d = statistics.median(r["ms"] for r in rows["dprorun"])
    print(f"dprorun vs horovodrun --autotune: iteration time {100 * (d / h - 1):+.1f} %, time to tune "
          f"{statistics.median(r['tune_s'] for r in rows['dprorun']):.1f} s vs "
          f"{statistics.median(r['tune_s'] for r in rows['horovod']):.1f} s")


if __name__ == "__main__":
    main()
