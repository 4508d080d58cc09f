"""How often TensorFlow's profiler kills a worker as it stops, and what becomes of the job: a 2-worker tf-keras fit
of an embedding model (benchmarks/shapes/tf_embedding_fit.py; the shape that showed it most, 3 of 7 launches)
launched --reps times under `dprorun --backend tf --warmup 15`. Per job: the launches it took (a worker that dies
inside the profiler's stop gets the job launched again: launch.relaunch_after_tf_stop_crash), its exit code, and
whether its last launch holds TensorFlow's profile. The first launch's crashes are what every job that crashed
there came to before the relaunch (the job failed).

    python benchmarks/tf_profiler_stop.py [--reps 10] [--script PATH] [--steps 60] [--warmup 15]

Last line: `profiler-stop crashes: A of L launches; jobs completed: C of N (B before the relaunch); profiled: P of N`.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--script", default=os.path.join(REPO, "benchmarks", "shapes", "tf_embedding_fit.py"))
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=15)
    args = parser.parse_args()
    crashes = launches = completed = first_ok = profiled = 0
    print("| job | launches | crashed in the stop | exit | last launch profiled |\n|---|---|---|---|---|", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            run_dir = os.path.join(tmp, f"job{rep}")
            cmd = [sys.executable, "-m", "dprorun.cli", "--backend", "tf", "--run-dir", run_dir, "--warmup",
                   str(args.warmup), "-q", "-np", "2", "python", args.script, "--steps", str(args.steps)]
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=1800,
                                  env=dict(os.environ, DPRO_REPORT="0"))
            with open(os.path.join(run_dir, "manifest.json")) as handle:
                manifest = json.load(handle)
            relaunches = len(manifest.get("relaunches") or [])
            crashed = relaunches + int(any(os.path.exists(os.path.join(run_dir, f"rank_{r}", "tf_profiler_stopping"))
                                           for r in (0, 1)))
            has_profile = all(os.path.exists(os.path.join(run_dir, f"rank_{r}", "xplane.pb")) for r in (0, 1))
            launches += relaunches + 1
            crashes += crashed
            completed += proc.returncode == 0
            first_ok += proc.returncode == 0 and relaunches == 0
            profiled += has_profile
            print(f"| {rep} | {relaunches + 1} | {crashed} | {proc.returncode} | {'yes' if has_profile else 'no'} |",
                  flush=True)
    print(f"profiler-stop crashes: {crashes} of {launches} launches; jobs completed: {completed} of {args.reps} "
          f"({first_ok} before the relaunch); profiled: {profiled} of {args.reps}")


if __name__ == "__main__":
    main()
