"""Scripts that run their own profiler, under dprorun: does the job run, does the script keep its profile, what
did dprorun profile, and what does the job-end self-check say.

Each job is a bundled example given `--own-profiler FIRST,LAST` (the script profiles those steps itself: DDP with
torch.profiler's schedule, TensorFlow with tf.profiler.experimental.start/stop, MXNet with mx.profiler's
set_config / run / stop / dump), placed over dprorun's window start (iteration 5; TensorFlow's iteration i is step
i + 1) or inside it. `--compare-with DIR` runs the same jobs with the dprorun of another checkout (e.g. a git
worktree of an older commit), job by job.

    python benchmarks/own_profiler.py [--jobs NAME,...] [--compare-with DIR] [--gpu]

Last line: `jobs that ran with the script's profile kept: A of N; with dprorun's op-level profile too: B of N` (a job
whose script profiles every step leaves dprorun no room for one: said in its summary).
"""
from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(REPO, "examples")
# name: (dprorun options, example, its arguments, module it needs)
JOBS = {
    "ddp-schedule-over-window-start": ([], "mlp_many_layers.py", ["--steps", "40", "--own-profiler", "6,8"], "torch"),
    "ddp-rank0-only": ([], "mlp_many_layers.py", ["--steps", "40", "--own-profiler", "6,8,0"], "torch"),
    "ddp-inside-window": ([], "resnet_small.py", ["--steps", "40", "--own-profiler", "10,12"], "torch"),
    "ddp-whole-job": ([], "mlp_many_layers.py", ["--steps", "40", "--own-profiler", "0,39"], "torch"),
    "tf-over-window-start": (["--backend", "tf"], "tf_custom_loop.py",
                             ["--steps", "40", "--width", "64", "--own-profiler", "4,7"], "tensorflow"),
    "mxnet-over-window-start": (["--backend", "mxnet", "--servers", "2"], "mxnet_gluon.py",
                                ["--steps", "40", "--model", "mlp", "--own-profiler", "4,7"], "mxnet-venv"),
}
CHECK = re.compile(r"replay of the job as it ran \(([0-9.]+) ms\) (agrees with|differs from) the run's \d+ clean "
                   r"iterations \(([0-9.]+) ms")


def _available(needs: str) -> bool:
    if needs != "mxnet-venv":
        return importlib.util.find_spec(needs) is not None
    return os.path.exists(os.path.expanduser("~/.cache/dprorun/mxnet-venv/bin/python"))


def _script_profile_kept(out: str) -> str:
    """Whether the script's own profile files exist and hold events (the paths the examples print)."""
    paths = re.findall(r"own (?:profiler traces|profile) in (\S+)", out)
    if not paths:
        return "no"
    for path in paths:
        files = [path] if os.path.isfile(path) else glob.glob(os.path.join(path, "**", "*"), recursive=True)
        if not any(os.path.isfile(f) and os.path.getsize(f) > 1000 for f in files):
            return "empty"
    return "yes"


def run_job(checkout: str, name: str, run_dir: str, gpu: bool = False) -> dict:
    options, example, arguments, _ = JOBS[name]
    if gpu and name.startswith("ddp-"):  # 2 ranks share one GPU: gloo over CUDA tensors (NCCL refuses that)
        arguments = [*arguments, "--backend", "gloo"]
    cmd = [sys.executable, "-m", "dprorun.cli", "--run-dir", run_dir, *options, "-np", "2", "python",
           os.path.join(EXAMPLES, example), *arguments]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=checkout, timeout=900,
                         env=dict(os.environ, DPRO_REPORT="0",
                                  PYTHONPATH=os.pathsep.join(filter(None, [checkout, os.environ.get("PYTHONPATH")]))))
    text = out.stdout + out.stderr
    if out.returncode != 0:  # the output's end says why (a crash's signal, a traceback)
        print(f"{name} ({checkout}): exit {out.returncode}; output's end:\n{text[-1500:]}", file=sys.stderr, flush=True)
    kineto = []
    events = os.path.join(run_dir, "rank_0", "events.json")
    if os.path.exists(events):
        kineto = json.load(open(events))["window"].get("kineto_iterations", [])
    op_level = any(os.path.exists(os.path.join(run_dir, "rank_0", f)) for f in
                   ("kineto_trace.json", "xplane.pb", "mx_profile.json"))
    found = CHECK.search(text)
    ps = re.search(r"predicted iteration time: ([0-9.]+) ms \(as run\)", text)
    check = (f"{float(found.group(1)):.1f} vs {float(found.group(3)):.1f} ms: {found.group(2).split()[0]}"
             if found else f"PS replay {ps.group(1)} ms" if ps else "none")
    crash = re.search(r"dprorun: error: (.{0,90})", text)
    return {"exit": out.returncode, "kept": _script_profile_kept(text),
            "profiled": f"{kineto[0]}-{kineto[-1]}" if kineto and op_level else "none",
            "check": check, "error": crash.group(1) if crash else ""}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", default=",".join(JOBS))
    parser.add_argument("--compare-with", help="another checkout's root: its dprorun runs the same jobs")
    parser.add_argument("--gpu", action="store_true", help="on a GPU machine: the DDP jobs' 2 ranks share GPU 0 "
                        "over gloo, the script's profiler records CUDA kernels and dprorun's CUPTI")
    args = parser.parse_args()
    checkouts = [("this", REPO)] + ([("other", os.path.abspath(args.compare_with))] if args.compare_with else [])
    print("| job | dprorun | exit | script's profile kept | dprorun's op-level profile | job-end check | error |")
    print("|---|---|---|---|---|---|---|")
    kept = profiled = total = 0
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.jobs.split(","):
            if not _available(JOBS[name][3]):
                print(f"| {name} | - | - | - | - | skipped: {JOBS[name][3]} is not installed | |", flush=True)
                continue
            for label, checkout in checkouts:
                row = run_job(checkout, name, os.path.join(tmp, f"{name}-{label}"), args.gpu)
                if label == "this":
                    total += 1
                    kept += row["exit"] == 0 and row["kept"] == "yes"
                    profiled += row["exit"] == 0 and row["kept"] == "yes" and row["profiled"] != "none"
                print(f"| {name} | {label} | {row['exit']} | {row['kept']} | {row['profiled']} | {row['check']} | "
                      f"{row['error']} |", flush=True)
    print(f"jobs that ran with the script's profile kept: {kept} of {total}; with dprorun's op-level profile too: "
          f"{profiled} of {total}")


if __name__ == "__main__":
    main()
