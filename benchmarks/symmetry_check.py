"""Symmetry in the replay, on recorded run directories: the folded ring (exact) and the search's one-rank
symmetric replay (an approximation when ranks differ) against the full graph.

For each RUN_DIR, world size in --worlds and bucket cap in --caps: the median-duration replay of the full graph
(every rank built), of the folded graph (what predictions use: the measured ranks repeat around the ring), and
of `representative(model)` (one rank: the slowest measured rank standing for all, what the optimizer uses from
4 ranks on). Then, at --timing-np, `predict()` (one replay per profiled iteration) folded vs every rank built.

usage: python benchmarks/symmetry_check.py RUN_DIR [RUN_DIR ...] [--worlds 4,8,16] [--caps 0.25,1,5,25]
       [--timing-np 128]
Last line: the largest folded and symmetric differences, and the timing.
"""
from __future__ import annotations

import argparse
import statistics
import time

from dprorun.analysis import RunAnalysis
from dprorun.replay.engine import replay
from dprorun.replay.build import build_job_model
from dprorun.replay.whatif import WhatIf
from dprorun.replay.synthesize import synthesize
from dprorun.replay.predict import predict, replay_once, representative


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dirs", nargs="+")
    parser.add_argument("--worlds", default="4,8,16")
    parser.add_argument("--caps", default="0.25,1,5,25")
    parser.add_argument("--timing-np", type=int, default=128)
    args = parser.parse_args()
    print(f"{'run':14} {'np':>4} {'cap MB':>6} {'full ms':>9} {'folded':>9} {'symmetric':>9} {'sym diff':>8}")
    folded_diffs, sym_diffs, rank_agree, cases = [], [], 0, 0
    models = {}
    for run_dir in args.run_dirs:
        run = RunAnalysis(run_dir).aligned_run
        model = models[run_dir] = build_job_model(run)
        for world in (int(w) for w in args.worlds.split(",")):
            full_by_cap, sym_by_cap = [], []
            for cap in (float(c) for c in args.caps.split(",")):
                whatif = WhatIf(world_size=world, bucket_mb=cap)
                full = replay(synthesize(model, whatif, [], fold=False)).iteration_time_us / 1000
                folded = replay_once(model, whatif)[0] / 1000
                sym = replay_once(representative(model), whatif)[0] / 1000
                folded_diffs.append(abs(folded / full - 1) * 100)
                sym_diffs.append((sym / full - 1) * 100)
                full_by_cap.append(full)
                sym_by_cap.append(sym)
                print(f"{run_dir[-14:]:14} {world:4d} {cap:6g} {full:9.2f} {folded:9.2f} {sym:9.2f} "
                      f"{sym_diffs[-1]:+7.2f}%")
            cases += 1
            rank_agree += sorted(range(len(full_by_cap)), key=full_by_cap.__getitem__) == \
                sorted(range(len(sym_by_cap)), key=sym_by_cap.__getitem__)
    run_dir = args.run_dirs[0]
    model = models[run_dir]
    whatif = WhatIf(world_size=args.timing_np)
    started = time.perf_counter()
    folded_pred = predict(model, whatif).predicted_iteration_time_ms
    folded_s = time.perf_counter() - started
    started = time.perf_counter()
    full_pred = statistics.median(replay(synthesize(model, whatif, [], sample, fold=False)).iteration_time_us / 1000
                                  for sample in (model.samples or [None]))
    full_s = time.perf_counter() - started
    print(f"predict at np {args.timing_np} on {run_dir}: folded {folded_pred:.4f} ms in {folded_s:.1f} s, every rank "
          f"built {full_pred:.4f} ms in {full_s:.1f} s ({len(model.samples)} iterations replayed)")
    print(f"folded vs full: max |diff| {max(folded_diffs):.2g} %; symmetric vs full: {min(sym_diffs):+.2f} … "
          f"{max(sym_diffs):+.2f} %, same ranking of caps in {rank_agree}/{cases}; np {args.timing_np}: "
          f"{full_s:.1f} s -> {folded_s:.1f} s")


if __name__ == "__main__":
    main()
