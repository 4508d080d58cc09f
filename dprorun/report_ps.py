"""The report of a parameter-server run (dprorun --backend mxnet): the same page as every run's (report.py renders
it), its data from the PS model and graph (replay/ps.py) instead of the torch trace model.

On the page: the workers' profiled iteration as measured (compute and push/pull per worker, updates per
server, one iteration of worker 0's profile, one host so one clock), the PS graph's replay of the job as it ran
with its critical path, the what-if curves (workers, bandwidth, servers), the check against the run's own
iterations without the profiler, the model's fitted costs.
"""
from __future__ import annotations

import os
import time
from typing import Union

from dprorun.fsutil import read_json
from dprorun.layout import MANIFEST_FILE, MX_PROFILE_FILE, rank_dir

WORKERS = (1, 2, 4, 8, 16)
BANDWIDTHS_GBIT = (1, 2.5, 10, 25, 100)
SERVERS = (1, 2, 4, 8)


def build_ps_report(run_dir: str, model=None) -> dict:
    """The page's data (the model as built at job end, else read from the run directory)."""
    from dprorun.replay.engine import critical_path_report, replay
    from dprorun.replay.ps import PSWhatIf, predict_ps, ps_graph
    from dprorun.replay.ps_model import build_ps_model
    from dprorun.report_data import graph_timeline

    model = model or build_ps_model(run_dir)
    as_run = predict_ps(model)
    graph = ps_graph(model, PSWhatIf())
    result = replay(graph)
    path = critical_path_report(graph, result, top=15)
    manifest = _manifest(run_dir)
    curve_notes: list[str] = []  # what the what-if curves assumed (_whatif_curves)
    measured = model.measured_iteration_us
    summary = {"job_id": manifest.get("job_id"), "command": manifest.get("command"), "world_size": model.workers,
               "iteration_time_ms": None if measured is None else round(measured / 1000, 3),
               "clean_iteration_time_ms": as_run.clean_ms, "problems": [], "memory": []}  # notes: the model's
    data = {"run_dir": os.path.abspath(run_dir), "generated": time.strftime("%Y-%m-%d %H:%M:%S"),
            "backend": "mxnet", "summary": summary, "replayed_label": "replayed (the PS graph, median durations)",
            "alignment": {"method": "one host, one clock (nothing to align)", "approximate": False,
                          "uncertainty_us": {}},
            "breakdown": _breakdown(model),
            "measured_timeline": _measured_timeline(run_dir),
            "replayed_timeline": graph_timeline(graph, result, _lane),
            "prediction": {"predicted_iteration_time_ms": round(as_run.iteration_ms, 3),
                           "measured_iteration_time_ms": summary["iteration_time_ms"],
                           "spread_ms": as_run.spread_ms, "self_check": _self_check(model, as_run),
                           "critical_path": {k: v for k, v in path.items() if k != "path"}},
            "whatif": _whatif_curves(model, curve_notes),
            "model": model.to_json(), "samples": [], "notes": list(as_run.notes)}
    check = data["prediction"]["self_check"]
    if check["status"] == "disagrees":  # else the page's header says it
        data["notes"].append(check["message"])
    data["notes"] += curve_notes
    return data


SPREAD = "the roles of this one-host profile laid over"  # ps.spread_note's opening


def _manifest(run_dir: str) -> dict:
    path = os.path.join(run_dir, MANIFEST_FILE)
    return read_json(path) if os.path.exists(path) else {}


def _lane(graph, node: int) -> Union[int, str]:
    """A PS graph's op on the page: workers by rank, servers (rank -1 - s) by name."""
    rank = int(graph.ranks[node])
    return rank if rank >= 0 else f"server {-1 - rank}"


def _breakdown(model) -> dict:
    """Per worker: its profiled iteration (medians over the complete ones), as the PS model took it."""
    rows = [[r, w.period_us / 1000, w.compute_us / 1000, w.dispatch_us / 1000, w.tail_us / 1000,
             w.profiled_iterations] for r, w in sorted(model.worker_ops.items())]
    return {"title": "Workers' profiled iterations (ms, medians over the complete ones; compute scaled "
                     f"x{model.compute_scale:.2f} in the replay)",
            "headers": ["worker", "iteration", "compute", "dispatch to first push", "last copy to next op",
                        "iterations"], "rows": rows}


def _self_check(model, as_run) -> dict:
    """What the replay of the job as it ran rests on. The PS model scales the profiled compute so that it replays
    to the run's own unprofiled iterations: that figure is fitted, not a check (the what-ifs are checked against
    measured runs in benchmarks/mxnet_replay_accuracy.py); the check left is how far the fit had to go."""
    measured = model.measured_iteration_us
    if measured is None:
        return {"status": "unchecked", "message": "no unprofiled iterations: the replay rests on the profile alone "
                                                  "(mx.profiler's own iterations, inflated by the profiler)"}
    from dprorun.replay.ps import compute_fit_disagrees

    fitted = abs(as_run.iteration_ms * 1000 / measured - 1) <= 0.02 and not compute_fit_disagrees(model, measured)
    return {"status": "fitted" if fitted else "disagrees",
            "message": f"the profiled compute was scaled x{model.compute_scale:.2f} so that the job as it ran "
                       f"replays to its {model.reference} iterations without the profiler ({measured / 1000:.2f} "
                       f"ms; replayed {as_run.iteration_ms:.2f} ms)"
                       + ("" if fitted else ": the profile and the job's own speed disagree; read the what-ifs "
                                            "with that margin")}


def _whatif_curves(model, notes: list[str]) -> dict:
    """The page's what-if curves; a one-host profile's bandwidth curve is laid over a host per worker
    (ps.absolute_layout): its first point's note saying so goes to `notes`."""
    from dprorun.replay.ps import PSWhatIf, predict_ps

    def curve(field: str, values) -> list:
        points = []
        for v in values:
            prediction = predict_ps(model, PSWhatIf(**{field: v}))
            if field == "bandwidth_gbit" and not points:
                notes.extend(f"the bandwidth curve: {note}" for note in prediction.notes if note.startswith(SPREAD))
            points.append([v, round(prediction.iteration_ms, 4)])
        return points

    return {"world_size": curve("workers", WORKERS), "bandwidth_gbit": curve("bandwidth_gbit", BANDWIDTHS_GBIT),
            "servers": curve("servers", SERVERS), "bucket_mb": [], "skipped": [], "folded": False}


def _measured_timeline(run_dir: str) -> dict:
    """One iteration of the workers' profiles (from the end of worker 0's first push/pull round to the end of its
    second): compute and kvstore lanes per worker, updates per server; ms from the iteration's start."""
    from dprorun.trace.mxprofile import comm_phases, numbered_files, read_mx_profile, read_server_updates

    workers = {r: read_mx_profile(p) for r, p in numbered_files(run_dir, rank_dir, MX_PROFILE_FILE).items()}
    groups = comm_phases([op for op in workers.get(0, []) if op.is_kvstore], workers.get(0, []))
    if len(groups) < 3:
        return {"iteration": None, "ops": []}
    lo, hi = max(op.end_us for op in groups[0]), max(op.end_us for op in groups[1])
    rows = []
    for r, ops in sorted(workers.items()):
        for op in ops:
            if lo <= op.start_us < hi:
                kind, lane = ("COMM", "kvstore") if op.is_kvstore else ("FW", "compute")
                rows.append([r, lane, kind, op.name, op.start_us, op.end_us])
    updates, _ = read_server_updates(run_dir)
    rows += [[f"server {u.server}", "update", "UPDATE", f"update k{u.key}", u.start_us, u.end_us]
             for u in updates if lo <= u.start_us < hi]
    return {"iteration": "2 of worker 0's profile",
            "ops": [[a, b, c, d, round((s - lo) / 1000, 4), round((e - lo) / 1000, 4)] for a, b, c, d, s, e in rows]}
