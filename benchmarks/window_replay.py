"""The replay of the job as it ran against the profiled window's own iterations (the figure `dpro replay` prints
as "measured iteration time"), for jobs of benchmarks/unseen_shapes.py: each job launched once per round (rounds
interleaved), each run replayed by this checkout and, with --compare-with, by another one on the same recorded
run, so the two replayers are compared on identical inputs; with --record-each, each checkout also records a run
of its own (a change to the hooks), the launches interleaved.

    git worktree add /tmp/wt_before <commit>
    python benchmarks/window_replay.py --rounds 3 --compare-with /tmp/wt_before \\
        --only ddp-lightning-manual-optimization-gan,ddp-gan,ddp-sam-two-passes-a-step

`--only stepping` runs the STEPPING jobs: more than one forward and backward a step (micro-batches, GANs, SAM, two
views), a step before the forward, halves trained in turn, and plain jobs beside them.

Last line: the median and the largest |replay / window - 1| of each checkout over every run.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

from unseen_shapes import JOBS, REPO, SHAPES


STEPPING = [
    "ddp-accumulate-2", "ddp-gan", "ddp-checkpointing", "ddp-zero", "ddp-frozen-trunk", "ddp-adamw-onecycle-clip",
    "ddp-lightning", "ddp-lightning-accumulate-2", "horovod-accumulate-2", "ddp-distill", "ddp-two-ddp", "ddp-ema",
    "ddp-lbfgs", "ddp-two-views-simclr", "ddp-accumulate-2-without-no-sync", "ddp-wgan-gp-generator-every-5",
    "ddp-lightning-manual-optimization-gan", "ddp-sam-two-passes-a-step", "horovod-gan-two-optimizers",
    "by-hand-gan-two-optimizers", "by-hand-accumulate-4", "ddp-nanogpt-require-backward-grad-sync-accumulate-4",
    "ddp-wgan-gp-gradient-penalty-double-backward", "ddp-moco-shuffle-bn-momentum-encoder-queue",
    "horovod-accumulate-by-hand-sgd-momentum", "ddp-token-budget-1-to-3-micro-batches-a-step",
    "ddp-encoder-decoder-trained-on-alternate-steps", "hf-trainer-accumulate-2", "ddp-accelerate-accumulate-2",
    "fsdp-accumulate-2-no-sync-first",
]


def replay_error(tree: str, run_dir: str) -> float | None:
    """`dpro replay RUN --json` run with `tree`'s dprorun: predicted / measured - 1, None where it gave none."""
    out = subprocess.run([sys.executable, "-m", "dprorun.offline_cli", "replay", run_dir, "--json"],
                         capture_output=True, text=True, cwd=tempfile.gettempdir(), timeout=300,
                         env=dict(os.environ, PYTHONPATH=tree))
    try:
        doc = json.loads(out.stdout)
        return doc["predicted_iteration_time_ms"] / doc["measured_iteration_time_ms"] - 1
    except (ValueError, KeyError, TypeError, ZeroDivisionError):
        return None


def launch(name: str, run_dir: str, steps: int, tree: str = REPO) -> int:
    options, script, script_args, _ = JOBS[name]
    path = os.path.join(REPO, script) if "/" in script else os.path.join(SHAPES, script)
    ranks = [] if "-np" in options else ["-np", "2"]
    cmd = [sys.executable, "-m", "dprorun.cli", "--run-dir", run_dir, *options, *ranks, "python", path,
           "--steps", str(steps), *script_args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=600,
                          env=dict(os.environ, DPRO_REPORT="0", PYTHONPATH=tree)).returncode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", required=True,
                        help="comma-separated job names of benchmarks/unseen_shapes.py, or 'stepping' (STEPPING)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--compare-with", help="another checkout's root: its replay of the same runs")
    parser.add_argument("--record-each", action="store_true",
                        help="with --compare-with: each checkout records its own runs (its hooks) and replays them")
    args = parser.parse_args()
    trees = {"this": REPO} | ({"other": os.path.abspath(args.compare_with)} if args.compare_with else {})
    errors: dict[str, list[float]] = {label: [] for label in trees}
    print("| job | round | " + " | ".join(f"{label} checkout" for label in trees) + " |")
    print("|---|---|" + "---|" * len(trees))
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for name in STEPPING if args.only == "stepping" else args.only.split(","):
                run_dirs = {label: os.path.join(tmp, f"{name}-{round_}-{label if args.record_each else 'both'}")
                            for label in trees}
                recorders = trees if args.record_each else {"this": REPO}
                if any(launch(name, run_dirs[label], args.steps, tree) != 0 for label, tree in recorders.items()):
                    print(f"| {name} | {round_} | " + " | ".join("exit != 0" for _ in trees) + " |", flush=True)
                    continue
                cells = []
                for label, tree in trees.items():
                    error = replay_error(tree, run_dirs[label])
                    cells.append("no replay" if error is None else f"{100 * error:+.1f} %")
                    if error is not None:
                        errors[label].append(abs(error))
                print(f"| {name} | {round_} | " + " | ".join(cells) + " |", flush=True)
    print("; ".join(f"{label}: median |error| {100 * np.median(v):.1f} %, max {100 * max(v):.1f} % ({len(v)} runs)"
                    for label, v in errors.items() if v))


if __name__ == "__main__":
    main()
