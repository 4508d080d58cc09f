"""Gradients all-reduced by the script itself (runtime/collectives.py): the replay of such a job as it ran, and its
what-ifs (the gradients in one flat all-reduce; the model wrapped in DistributedDataParallel, default buckets),
against real runs of those jobs (benchmarks/shapes/by_hand_session45.py --style loop | flat | ddp).

Rounds interleave the three styles; each style's reference is the median over rounds of its runs' iterations
without profiling (the clean ones after the window). Two models: an MLP and a conv net with BatchNorm (Adam).
`python benchmarks/by_hand_whatifs.py [--rounds 3] [--steps 60] [--net loopback|1gbit] [--keep DIR]`; the last line
gives the median absolute errors. --net 1gbit runs every launch in a network namespace whose loopback is a 1 Gbit/s
tbf link (scripts/with-netns-1gbit; needs root).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "benchmarks", "shapes", "by_hand_session45.py")
NETNS = os.path.join(REPO, "scripts", "with-netns-1gbit")
STYLES = ("loop", "flat", "ddp")
MODELS = {"mlp": ["--model", "mlp"], "conv-adam": ["--model", "conv", "--adam"]}


def profile(run_dir: str, style: str, model_args: list[str], steps: int, net: str) -> None:
    cmd = ([NETNS, "--"] if net == "1gbit" else []) + [sys.executable, "-m", "dprorun.cli", "--run-dir", run_dir, "-np", "2", "python", SCRIPT, "--style", style,
           "--steps", str(steps), *model_args]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=600, env=dict(os.environ,
                                                                                             DPRO_REPORT="0"))
    if out.returncode != 0:
        raise SystemExit(f"{style}: exit {out.returncode}\n{out.stderr[-2000:]}")


def predictions(run_dir: str) -> dict[str, float]:
    """ms: the loop job's replay as it ran, and its two what-ifs."""
    from dprorun.analysis import RunAnalysis
    from dprorun.optimize.search import after_the_backward, ready_order
    from dprorun.replay.predict import predict
    from dprorun.replay.template import ddp_buckets
    from dprorun.replay.whatif import MB, WhatIf

    analysis = RunAnalysis(run_dir)
    model = analysis.model
    ddp = ddp_buckets(ready_order(model), model.param_bytes, 25 * MB, MB, model.sparse_gradients())
    return {"loop": analysis.prediction.predicted_iteration_time_ms,
            "flat": predict(model, WhatIf(buckets=[ready_order(model)],
                                          ready_groups=after_the_backward(model))).predicted_iteration_time_ms,
            "ddp": predict(model, WhatIf(buckets=ddp)).predicted_iteration_time_ms}


def clean_ms(run_dir: str) -> float:
    from dprorun.analysis import RunAnalysis

    return statistics.median(RunAnalysis(run_dir).model.clean_iterations_us) / 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--net", choices=("loopback", "1gbit"), default="loopback")
    parser.add_argument("--keep", help="keep the run directories under this folder (default: a temporary one)")
    args = parser.parse_args()
    errors: list[float] = []
    print("| model | style | measured ms (median of rounds, spread) | predicted from the loop job ms | error |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as scratch:
        tmp = args.keep or scratch
        for name, model_args in MODELS.items():
            measured: dict[str, list[float]] = {s: [] for s in STYLES}
            predicted: dict[str, list[float]] = {s: [] for s in STYLES}
            for k in range(args.rounds):
                for style in STYLES:
                    run_dir = os.path.join(tmp, f"{name}-{style}-{k}")
                    profile(run_dir, style, model_args, args.steps, args.net)
                    measured[style].append(clean_ms(run_dir))
                    if style == "loop":
                        for what, ms in predictions(run_dir).items():
                            predicted[what].append(ms)
            for style in STYLES:
                m, p = statistics.median(measured[style]), statistics.median(predicted[style])
                spread = f"{min(measured[style]):.2f}-{max(measured[style]):.2f}"
                errors.append(abs(p / m - 1))
                label = {"loop": "as run", "flat": "what-if: one flat all-reduce",
                         "ddp": "what-if: DDP, default buckets"}[style]
                print(f"| {name} | {style} ({label}) | {m:.2f} ({spread}) | {p:.2f} | {100 * (p / m - 1):+.1f} % |",
                      flush=True)
    print(f"median absolute error over {len(errors)} predictions: {100 * statistics.median(errors):.1f} % "
          f"(worst {100 * max(errors):.1f} %)")


if __name__ == "__main__":
    main()
