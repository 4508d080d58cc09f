"""Replay accuracy for Horovod jobs: the measured iteration time of a plain `horovodrun` run vs the replayed
prediction from a `dprorun --backend horovod` run of the same job, interleaved --reps times (medians).

usage: OMP_NUM_THREADS=1 [sudo] python benchmarks/horovod_replay_accuracy.py [--nets loopback,1gbit] [--reps 3]
       [--model mlp|transformer|resnet|convhead|tf-conv|tf-mlp-adam|tf-keras-fit|hand-grouped|hand-async|hand-hooks|
       hand-zero]
(horovodrun, unlike torchrun, leaves OMP_NUM_THREADS alone; on 2 cores two ranks with 2 OpenMP threads each
thrash (260-700 ms per iteration instead of 30), so both sides get OMP_NUM_THREADS=1 from the environment.)
Last line: the median and max |error| over the networks.
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
EXAMPLE = os.path.join(REPO, "examples", "horovod_mlp.py")


def wrap(net: str, cmd: list[str]) -> list[str]:
    return [NETNS, "--"] + cmd if net == "1gbit" else cmd


TF_EXAMPLE = os.path.join(REPO, "examples", "horovod_tf.py")
TF_MODELS = {"tf-conv": ["--model", "conv"], "tf-mlp-adam": ["--model", "mlp", "--optimizer", "adam"],
             "tf-keras-fit": []}
# gradients shared by the script's own horovod.torch calls, no DistributedOptimizer (benchmarks/shapes/hvd_session51.py)
BY_HAND = os.path.join(REPO, "benchmarks", "shapes", "hvd_session51.py")
BY_HAND_MODELS = {"hand-grouped": "--grouped", "hand-async": "--async-after", "hand-hooks": "--async-hooks",
                  "hand-zero": "--reducescatter"}


def example_args(model: str) -> list[str]:
    """The script and its model flags: examples/horovod_mlp.py (horovod.torch) or, for the tf-* models,
    examples/horovod_tf.py (horovod.tensorflow)."""
    if model == "tf-keras-fit":
        return [os.path.join(REPO, "examples", "horovod_tf_keras.py")]
    if model in TF_MODELS:
        return [TF_EXAMPLE, *TF_MODELS[model]]
    if model in BY_HAND_MODELS:
        return [BY_HAND, BY_HAND_MODELS[model]]
    return [EXAMPLE, "--model", model]


def script_median_ms(stdout: str) -> float:
    """The example's own timer: horovod_mlp.py's "median iteration time", horovod_tf.py's "median step"."""
    found = re.search(r"median (?:iteration time:|step) ([0-9.]+) ms", stdout)
    if found is None:
        raise RuntimeError(f"no median in the script's output: {stdout[-500:]}")
    return float(found.group(1))


def measured_ms(net: str, steps: int, batch: int, knobs: tuple = (), model: str = "mlp") -> float:
    """A plain horovodrun run's median iteration time; `knobs`: extra horovodrun flags (fusion, cycle)."""
    out = subprocess.run(wrap(net, ["horovodrun", "-np", "2", "--gloo", *knobs, sys.executable, *example_args(model),
                                    "--steps", str(steps), "--batch-size", str(batch)]),
                         capture_output=True, text=True, check=True, timeout=900, cwd=REPO)
    return script_median_ms(out.stdout)


def predicted_ms(net: str, steps: int, batch: int, model: str = "mlp") -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = os.path.join(tmp, "run")
        # the window over the second half, as the plain run's median; 10 clean iterations (the default, enough
        # for the self-check; 5 scattered too widely to judge by)
        warmup, clean = steps // 2, 10
        active = steps - warmup - clean - 2
        subprocess.run(wrap(net, [sys.executable, "-m", "dprorun.cli", "--backend", "horovod", "-np", "2", "-q",
                                  "--run-dir", run_dir, "--warmup", str(warmup), "--active", str(active),
                                  "--kineto-iters", "3", "--clean", str(clean), "python", *example_args(model),
                                  "--steps", str(steps), "--batch-size", str(batch)]),
                       capture_output=True, text=True, check=True, timeout=900, cwd=REPO,
                       env=dict(os.environ, DPRO_REPORT="0"))
        out = subprocess.run([sys.executable, "-m", "dprorun.offline_cli", "replay", run_dir, "--json"],
                             capture_output=True, text=True, check=True, timeout=600, cwd=REPO)
        doc = json.loads(out.stdout)
        return doc["predicted_iteration_time_ms"], doc["measured_iteration_time_ms"]


def common_parser(doc: str) -> argparse.ArgumentParser:
    """The arguments every Horovod benchmark takes."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--nets", default="loopback,1gbit")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--model", default="mlp",
                        choices=("mlp", "transformer", "resnet", "convhead", "mixed", *TF_MODELS, *BY_HAND_MODELS),
                        help="examples/horovod_mlp.py --model; tf-conv, tf-mlp-adam: examples/horovod_tf.py "
                             "(horovod.tensorflow); tf-keras-fit: examples/horovod_tf_keras.py; hand-*: "
                             "benchmarks/shapes/hvd_session51.py (gradients shared by horovod.torch calls by hand)")
    return parser


def usable_nets(spec: str) -> list[str]:
    """--nets, without the 1 Gbit namespace when not root (it needs `ip netns`)."""
    nets = spec.split(",")
    if "1gbit" in nets and os.geteuid() != 0:
        print("note: not root, the 1 Gbit network namespace is skipped")
        nets = [n for n in nets if n != "1gbit"]
    return nets


def main() -> None:
    args = common_parser(__doc__).parse_args()
    nets = usable_nets(args.nets)
    print(f"{'net':8} {'horovodrun ms':>13} {'dPRO ms':>8} {'error':>7} {'own run ms':>10}  readings")
    errors = []
    for net in nets:
        measured, predicted, own = [], [], []
        for _ in range(args.reps):
            measured.append(measured_ms(net, args.steps, args.batch_size, model=args.model))
            p, o = predicted_ms(net, args.steps, args.batch_size, model=args.model)
            predicted.append(p)
            own.append(o)
        m, p = statistics.median(measured), statistics.median(predicted)
        err = 100 * (p / m - 1)
        errors.append(abs(err))
        print(f"{net:8} {m:13.2f} {p:8.2f} {err:+6.1f}% {statistics.median(own):10.2f}  "
              f"measured {' '.join(f'{x:.1f}' for x in measured)} / predicted {' '.join(f'{x:.1f}' for x in predicted)}",
              flush=True)
    print(f"Horovod replay |error| vs horovodrun: median {statistics.median(errors):.1f} %, max {max(errors):.1f} %")


if __name__ == "__main__":
    main()
