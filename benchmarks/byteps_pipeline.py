"""BytePS partition pipeline: each recorded step's synchronisation time predicted from the other steps.

Reads real BytePS comm.json files (default: ../shared/fixtures/byteps/*.json.gz, recorded by BytePS, not by this
project), takes every stage's service time per partition as the median over the other steps, replays the
step's partition pipeline (one device per stage) and compares with the step's recorded "total" span; with one
root GPU's file among several of one machine, also the machine's step with the GPUs replayed together (the
others wait for the root's PULLs). Also the time per read and replay, and a what-if (--stage-scale, default
PUSH and PULL at half their service time).

usage: python benchmarks/byteps_pipeline.py [FILE ...] [--stage-scale PUSH=0.5,PULL=0.5]
"""
import argparse
import glob
import os
import statistics
import time

from dprorun.import_cli import parse_stage_scale
from dprorun.replay.pipeline import predict_machine_steps, predict_steps
from dprorun.trace.byteps import read_byteps_comm

DEFAULT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "shared",
                       "fixtures", "byteps")


def row(name: str, role: str, partitions: int, predictions: list, whatif: list, read_s: str,
        replay_ms: float) -> list[float]:
    """Print one table row; returns its per-step |errors| (%)."""
    errors = [abs(p.error) * 100 for p in predictions]
    print(f"| {name} | {role} | {partitions} | {len(predictions)} | "
          f"{statistics.median(p.measured_us for p in predictions) / 1000:.2f} | "
          f"{statistics.median(p.predicted_us for p in predictions) / 1000:.2f} | "
          f"{statistics.median(errors):.2f} % | {max(errors):.2f} % | "
          f"{statistics.median(p.predicted_us for p in whatif) / 1000:.2f} | {read_s} | {replay_ms:.1f} |")
    return errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*")
    parser.add_argument("--stage-scale", type=parse_stage_scale, default={"PUSH": 0.5, "PULL": 0.5})
    args = parser.parse_args()
    files = args.files or sorted(glob.glob(os.path.join(DEFAULT, "*.json*")))
    if not files:
        raise SystemExit(f"no comm.json given and none in {DEFAULT}")
    print("| file | role | partitions | steps | measured ms (median) | predicted ms (median) | |error| median | "
          "max | what-if ms | read s | replay ms/step |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    all_errors = []
    for path in files:
        started = time.perf_counter()
        bt = read_byteps_comm(path)
        read_s = time.perf_counter() - started
        started = time.perf_counter()
        predictions = predict_steps(bt)
        replay_ms = 1000 * (time.perf_counter() - started) / len(predictions)
        all_errors += row(os.path.basename(path), bt.role, sum(bt.partitions.values()), predictions,
                          predict_steps(bt, args.stage_scale), f"{read_s:.2f}", replay_ms)
    traces = [read_byteps_comm(path, rank=k) for k, path in enumerate(files)]
    if len(traces) > 1 and sum(bt.role == "root" for bt in traces) == 1:  # one machine's GPUs: replayed together
        root = next(bt for bt in traces if bt.role == "root")
        others = [bt for bt in traces if bt is not root]
        started = time.perf_counter()
        predictions = predict_machine_steps(root, others)
        replay_ms = 1000 * (time.perf_counter() - started) / len(predictions)
        all_errors += row(f"all {len(traces)} (one machine)", f"root + {len(others)}", sum(root.partitions.values()),
                          predictions, predict_machine_steps(root, others, args.stage_scale), "", replay_ms)
    print(f"per-step sync time predicted from the other steps: |error| median {statistics.median(all_errors):.2f} %, "
          f"max {max(all_errors):.2f} % over {len(all_errors)} steps")


if __name__ == "__main__":
    main()
