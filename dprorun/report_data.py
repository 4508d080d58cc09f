"""The report's data, computed from a run's one analysis (dprorun/analysis.py: read and aligned once).

`build_report(analysis) -> dict`: the job and per-rank breakdown, one measured iteration of the first ranks on the
reference clock, the replayed iteration with its critical path, what-if curves (iteration time vs world size,
bandwidth, bucket size; each a replay of the median iteration, bounded in time; one representative rank from 16
ranks on), the optimizer's strategy and autotune's measured before/after when the run directory has them, peak
memory per rank, the host/GPU samples, the alignment's uncertainty and the replay's self-check. Rendering (HTML,
terminal) is dprorun/report.py's.
"""
from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

from dprorun.fsutil import read_json
from dprorun.replay.build import SCRIPT_ALL_REDUCES
from dprorun.trace.model import OpKind, RunTrace

if TYPE_CHECKING:
    from dprorun.analysis import RunAnalysis

WORLD_SIZES = (2, 4, 8, 16, 32, 64, 128)
BANDWIDTHS_GBIT = (1, 2.5, 10, 25, 100)
BUCKETS_MB = (0.25, 1, 5, 25, 100)
MAX_WHATIF_OPS = 2_000_000  # a curve point whose replay graph would be larger is skipped (and said so)


def _measured_timeline(run: RunTrace) -> dict:
    """One profiled iteration per rank (the last one without torch.profiler where possible), times in ms from
    the earliest start, lanes per rank: phases, comm, GPU streams."""
    rows = []
    common = None
    for trace in run.ranks.values():
        clean = set(trace.unprofiled_window_iterations()) or set(trace.profiled_iterations)
        common = clean if common is None else common & clean
    iteration = max(common) if common else None
    if iteration is None:
        return {"iteration": None, "ops": []}
    for rank, trace in sorted(run.ranks.items())[:SHOWN_RANKS]:
        for op in trace.ops:
            if op.iteration != iteration or op.kind is OpKind.VIRTUAL:
                continue
            if op.stream == "phase":
                lane = "phases"
            elif op.kind in (OpKind.COMM, OpKind.QUEUE):
                lane = "comm"
            elif op.stream.startswith("cuda:"):
                lane = op.stream
            else:
                continue  # profiler CPU ops are in the Perfetto export (dpro timeline); too many for a page
            rows.append([rank, lane, op.kind.value, op.name, op.start_us, op.end_us])
    if not rows:
        return {"iteration": iteration, "ops": []}
    origin = min(r[4] for r in rows)
    ops = [[r[0], r[1], r[2], r[3], round((r[4] - origin) / 1000, 4), round((r[5] - origin) / 1000, 4)]
           for r in rows]
    return {"iteration": iteration, "ops": ops}


FOLD_FROM_RANKS = 16  # what-if curves of runs this large replay one representative rank
SHOWN_RANKS = 16  # timelines on the page show the first ranks of a large run


def _replayed_timeline(model) -> dict:
    from dprorun.replay.engine import replay
    from dprorun.replay.whatif import WhatIf
    from dprorun.replay.synthesize import synthesize

    graph = synthesize(model, WhatIf(), [])
    return graph_timeline(graph, replay(graph))


def graph_timeline(graph, result, lane=None) -> dict:
    """A replayed graph on the page: its ops' [lane, device, kind, name, start ms, end ms, on the critical path]
    (lanes: the op's rank, or what `lane(graph, node)` says), ranks beyond SHOWN_RANKS left out; the critical
    path's top ops."""
    from dprorun.replay.engine import KIND_NAMES, critical_path_report

    critical = set(result.critical_path)
    ops = []
    for k in range(graph.size):
        kind = KIND_NAMES[graph.kinds[k]]
        if kind == "VIRTUAL" or result.end_us[k] <= result.start_us[k] or graph.ranks[k] >= SHOWN_RANKS:
            continue
        device = graph.device_names[graph.devices[k]] if graph.devices[k] >= 0 else "-"
        ops.append([lane(graph, k) if lane else int(graph.ranks[k]), device, kind, graph.names[k],
                    round(float(result.start_us[k]) / 1000, 4), round(float(result.end_us[k]) / 1000, 4),
                    k in critical])
    path = critical_path_report(graph, result, top=15)
    return {"iteration_ms": round(result.iteration_time_us / 1000, 4), "ops": ops,
            "critical_path": {k: v for k, v in path.items() if k != "path"}}


def _whatif_curves(model, time_budget_s: float, max_ops: int = MAX_WHATIF_OPS) -> dict:
    from dprorun.replay.whatif import WhatIf
    from dprorun.replay.predict import predict, replay_once, representative

    started = time.monotonic()
    buckets = max(1, len(model.buckets))
    curves: dict = {"world_size": [], "bandwidth_gbit": [], "bucket_mb": [], "skipped": [], "folded": False}
    if len(model.templates) >= FOLD_FROM_RANKS:  # every rank alike: one built rank answers each point
        model = representative(model)
        curves["folded"] = True

    def point(curve: str, x: float, whatif: WhatIf, ops_estimate: int) -> None:
        if curves["folded"]:
            ops_estimate //= max(1, whatif.world_size or model.world_size)
        if ops_estimate > max_ops or time.monotonic() - started > time_budget_s:
            curves["skipped"].append(f"{curve}={x:g}")
            return
        try:
            if model.blocking_collectives:  # its ranks meet at every call: one replay of median durations misses
                # their waits (FSDP, 2 ranks: 37.6 ms against 47.6 over the iterations, as `dpro replay` prints)
                t = predict(model, whatif, detail="coarse").predicted_iteration_time_ms * 1000
            else:
                t, _ = replay_once(model, whatif)
        except ValueError as exc:  # e.g. re-bucketing without gradient-ready times
            curves["skipped"].append(f"{curve}={x:g} ({exc})")
            return
        curves[curve].append([x, round(t / 1000, 4)])

    for n in WORLD_SIZES:
        point("world_size", n, WhatIf(world_size=n), n * buckets * 2 * 2 * (n - 1) + 10 * n)
    world = model.world_size
    for bw in BANDWIDTHS_GBIT:
        point("bandwidth_gbit", bw, WhatIf(bandwidth_gbit=bw), world * buckets * 4 * max(world - 1, 1))
    total = sum(model.param_bytes.values())
    for mb in BUCKETS_MB:
        n_buckets = max(1, int(total / (mb * (1 << 20))) + 1)
        point("bucket_mb", mb, WhatIf(bucket_mb=mb), world * n_buckets * 4 * max(world - 1, 1))
    return curves


def _samples(run: RunTrace) -> list[dict]:
    series = []
    for rank, trace in sorted(run.ranks.items()):
        for source in sorted({s.source for s in trace.samples}):
            points = [s for s in trace.samples if s.source == source]
            if not points:
                continue
            origin = points[0].time_us
            keys = sorted({k for s in points for k in s.values})
            for key in keys:
                values = [[round((s.time_us - origin) / 1e6, 3), s.values[key]] for s in points if key in s.values]
                series.append({"rank": rank, "source": source, "metric": key, "points": values})
    return series


def build_report(analysis: "RunAnalysis", whatif_time_budget_s: float = 60.0,
                 max_whatif_ops: int = MAX_WHATIF_OPS) -> dict:
    run_dir = analysis.run_dir
    summary = analysis.summary
    alignment = analysis.alignment
    run = analysis.aligned_run
    data: dict = {"run_dir": os.path.abspath(run_dir), "generated": time.strftime("%Y-%m-%d %H:%M:%S"),
                  "summary": summary, "alignment": {"method": alignment.method,
                                                    "approximate": alignment.approximate,
                                                    "offsets_us": alignment.offsets_us,
                                                    "uncertainty_us": alignment.to_json()["uncertainty_us"],
                                                    "warnings": alignment.warnings},
                  "measured_timeline": _measured_timeline(run), "samples": _samples(run),
                  # a job launched again (TensorFlow's profiler stop) or restarted by torch elastic (--max-restarts):
                  # the page shows the last launch's or attempt's profile, and says why there were others
                  "notes": [str(why) for why in (run.manifest or {}).get("relaunches") or []]}
    try:
        model = analysis.model
        prediction = analysis.prediction
        data["prediction"] = {"predicted_iteration_time_ms": prediction.predicted_iteration_time_ms,
                              "measured_iteration_time_ms": prediction.measured_iteration_time_ms,
                              "spread_ms": prediction.spread_ms, "self_check": prediction.self_check,
                              "critical_path": prediction.critical_path, "comm_model": prediction.comm_model}
        if prediction.self_check and prediction.self_check["status"] != "agrees":
            data["notes"].append(prediction.self_check["message"])
        data["notes"] += [note for note in prediction.notes if note.startswith("warning") and note not in data["notes"]]
        if model.framework == "collectives":  # what was replayed as buckets (build._script_all_reduces)
            data["notes"] += [note for note in model.notes if note.startswith(SCRIPT_ALL_REDUCES)]
        data["replayed_timeline"] = _replayed_timeline(model)
        data["whatif"] = _whatif_curves(model, whatif_time_budget_s, max_whatif_ops)
        if data["whatif"]["folded"]:
            data["notes"].append(f"what-if curves of this {model.world_size}-rank run replay one representative rank "
                                 "(the slowest measured one; every rank alike): exact for a symmetric job")
        if len(run.ranks) > SHOWN_RANKS:
            data["notes"].append(f"timelines show ranks 0-{SHOWN_RANKS - 1} of {len(run.ranks)} "
                                 "(dpro timeline exports every rank)")
        data["notes"] += [p for p in run.problems if p.startswith("large run")]
        if model.transport and model.transport.get("shares_cores"):
            data["notes"].append(
                "the what-if curves assume communication runs beside compute; this job's transport is CPU work "
                f"on the cores its ranks compute on (busy {100 * model.transport['transport_cpu_share']:.0f} % of "
                "its all-reduces' time), so curves that add collectives or overlap are optimistic here")
    except ValueError as exc:  # nothing replayable (e.g. no complete profiled iteration): say so on the page
        data["notes"].append(f"no replay: {exc}")
    for name in ("strategy.json", "autotune.json"):
        path = os.path.join(run_dir, name)
        if os.path.exists(path):
            data[name.split(".")[0]] = read_json(path)
    variants = next((t.meta.get("compute_variants") for t in run.ranks.values() if t.meta.get("compute_variants")),
                    None)
    profiled = os.path.join(run_dir, "autotune", "profile", "rank_0", "variants.json")
    if not variants and os.path.exists(profiled):  # --autotune: timed in its profiling phase
        variants = (read_json(profiled) or {}).get("variants")
    if variants:
        data["compute_variants"] = variants
    return data
