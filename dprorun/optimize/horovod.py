"""Horovod's own knobs as a search: fusion threshold x cycle time, each candidate replayed with Horovod's
cycle/threshold fusion (`WhatIf.horovod_fusion_mb/horovod_cycle_ms`), ranked by predicted iteration time.

With its cost model calibrated on Horovod's own calls the fusion model is within 7.5 % on a 1 Gbit/s network but
20-40 % high where the transport is CPU work on the ranks' cores (benchmarks/RESULTS.md), so the ranking is
used to choose which few candidates deserve a real trial window (dprorun --autotune --backend horovod runs
the top ones and keeps the fastest measured, if it beats the job's own settings), not to decide alone.
"""
from __future__ import annotations

import time

from dprorun.replay.template import JobModel
from dprorun.replay.whatif import MB, WhatIf
from dprorun.replay.predict import replay_once
from dprorun.strategy import Decision, Strategy, transport_caution
from dprorun.fsutil import UnanswerableError

THRESHOLDS_MB = (0.0, 1.0, 4.0, 16.0, 64.0, 128.0)
CYCLES_MS = (0.5, 1.0, 2.5, 5.0, 10.0)


def rank_horovod_knobs(model: JobModel, thresholds_mb=THRESHOLDS_MB, cycles_ms=CYCLES_MS,
                       top: int = 2) -> list[Strategy]:
    """The `top` (threshold, cycle) settings by replayed iteration time, best first, each as a Strategy whose
    baseline is the replay of the knobs the job ran with. Settings within 1 % of the as-run prediction are not
    offered (nothing to gain worth a trial)."""
    if model.framework == "collectives" and model.script_calls_library == "horovod.torch":
        raise UnanswerableError("the gradients are shared by the script's own horovod.torch calls (no "
                                "hvd.DistributedOptimizer): dprorun cannot change those calls, and replays Horovod's "
                                "fusion threshold and cycle time for a DistributedOptimizer's all-reduces only")
    if model.framework != "horovod":
        raise UnanswerableError("Horovod knobs apply to Horovod runs only")
    started = time.monotonic()
    threshold_bytes, cycle_us = model.horovod_knobs or (128 * MB, 1000.0)
    as_run_mb, as_run_ms = threshold_bytes / MB, cycle_us / 1000.0
    baseline_us, _ = replay_once(model, WhatIf(horovod_fusion_mb=as_run_mb, horovod_cycle_ms=as_run_ms))
    scored = []
    for threshold in thresholds_mb:
        for cycle in cycles_ms:
            if (threshold, cycle) == (as_run_mb, as_run_ms):
                continue
            t, _ = replay_once(model, WhatIf(horovod_fusion_mb=threshold, horovod_cycle_ms=cycle))
            scored.append((t, threshold, cycle))
    scored.sort()
    seconds = round(time.monotonic() - started, 3)
    out = []
    for t, threshold, cycle in scored[:top]:
        if t >= baseline_us * 0.99:
            break
        decision = Decision("horovod_fusion", f"fusion threshold {threshold:g} MB, cycle time {cycle:g} ms",
                            round(baseline_us / 1000, 4), round(t / 1000, 4),
                            f"as run: {as_run_mb:g} MB, {as_run_ms:g} ms")
        out.append(Strategy(horovod_fusion_threshold_mb=threshold, horovod_cycle_time_ms=cycle,
                            baseline_ms=round(baseline_us / 1000, 4), predicted_ms=round(t / 1000, 4),
                            decisions=[decision],
                            search={"evaluations": len(scored) + 1, "seconds": seconds,
                                    "world_size": model.world_size, "framework": "horovod",
                                    **transport_caution(model)}))
    return out
