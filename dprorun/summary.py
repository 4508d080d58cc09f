"""The run summary: measured iteration time per rank and where it goes (compute / communication / idle).

Per profiled iteration of a rank:
  compute        forward + backward + optimizer update spans (the hooks' phase spans)
  communication  union of the buckets' transmission intervals; `exposed` is the part not hidden behind compute
  queueing       time buckets waited between being ready and starting to transmit
  idle / other   iteration time - compute - exposed communication (data loading, Python, waiting)
Values are medians over the profiled iterations, in milliseconds.
"""
from __future__ import annotations

from typing import Iterable, Optional

from dprorun.graph.local import blocking_collectives
from dprorun.memory import run_memory
from dprorun.trace.model import OpKind, RankTrace, RunTrace, is_tf_tracker
from dprorun.trace.rundir import load_run
from dprorun.stats import median


def union_length(intervals: Iterable[tuple[float, float]]) -> float:
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def _merge(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def overlap_length(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    a, b = _merge(a), _merge(b)
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def _median_ms(values: list[float]) -> Optional[float]:
    value = median(values)
    return None if value is None else round(value / 1000.0, 3)


def rank_breakdown(trace: RankTrace) -> dict:
    """Medians over the window's iterations; a TensorFlow worker's breakdown over its profiled steps (the only
    ones whose phases are known: its hooks see whole steps)."""
    by_iter: dict[int, dict[str, list]] = {i: {"compute": [], "comm": [], "queue": [], "fw": [], "bw": [],
                                                "update": []} for i in trace.profiled_iterations}
    for op in trace.ops:
        slot = by_iter.get(op.iteration)
        if slot is None:
            continue
        interval = (op.start_us, op.end_us)
        if op.stream == "phase":
            slot["compute"].append(interval)
            slot[{OpKind.FW: "fw", OpKind.BW: "bw", OpKind.UPDATE: "update"}.get(op.kind, "compute")].append(interval)
        elif op.kind is OpKind.COMM and op.source == "hooks":
            slot["comm"].append(interval)
        elif op.kind is OpKind.QUEUE:
            slot["queue"].append(interval)
    iteration_len = {i: end - start for i, start, end in trace.iterations}
    rows = {k: [] for k in ("iter", "compute", "fw", "bw", "update", "comm", "exposed", "queue", "idle",
                            "kineto_iter")}
    hooks_only = set(trace.unprofiled_window_iterations())
    tf_worker = any(is_tf_tracker(t) for t in trace.meta.get("trackers", []))
    with_phases = set(trace.meta.get("kineto_iterations", [])) if tf_worker else hooks_only
    # each collective held the rank's thread (FSDP on the CPU): its time inside a phase is no compute, none hidden
    blocking = blocking_collectives(trace)

    def busy(intervals: list, comm: list) -> float:
        return union_length(intervals) - (overlap_length(comm, intervals) if blocking else 0.0)
    for i, slot in by_iter.items():
        if slot["queue"]:
            rows["queue"].append(union_length(slot["queue"]))
        if i in hooks_only:
            rows["iter"].append(iteration_len[i])
        else:
            rows["kineto_iter"].append(iteration_len[i])
        if i not in with_phases:
            continue
        total = iteration_len[i]
        compute = busy(slot["compute"], slot["comm"])
        comm = union_length(slot["comm"])
        exposed = comm - (0.0 if blocking else overlap_length(slot["comm"], slot["compute"]))
        rows["compute"].append(compute)
        rows["fw"].append(busy(slot["fw"], slot["comm"]))
        rows["bw"].append(busy(slot["bw"], slot["comm"]))
        rows["update"].append(busy(slot["update"], slot["comm"]))
        rows["comm"].append(comm)
        rows["exposed"].append(exposed)
        rows["idle"].append(max(0.0, total - compute - exposed))
    clean = [end - start for i, start, end in trace.iterations if i in set(trace.meta.get("clean_iterations", []))]
    n_comm = sum(1 for op in trace.ops if op.kind is OpKind.COMM and op.source == "hooks")
    return {
        "rank": trace.rank,
        "host": trace.host,
        "profiled_iterations": len(trace.profiled_iterations),
        "iteration_time_ms": _median_ms(rows["iter"]),
        "kineto_iteration_time_ms": _median_ms(rows["kineto_iter"]),
        "clean_iteration_time_ms": _median_ms(clean),
        "compute_ms": _median_ms(rows["compute"]),
        "forward_ms": _median_ms(rows["fw"]),
        "backward_ms": _median_ms(rows["bw"]),
        "update_ms": _median_ms(rows["update"]),
        "comm_ms": _median_ms(rows["comm"]),
        "exposed_comm_ms": _median_ms(rows["exposed"]),
        "queue_ms": _median_ms(rows["queue"]),
        "idle_ms": _median_ms(rows["idle"]),
        "buckets": len(trace.buckets),
        "comm_events": n_comm,
        "nvml": trace.meta.get("nvml_status"),
        "warnings": trace.warnings,
    }


def summarize(run: RunTrace) -> dict:
    ranks = [rank_breakdown(run.ranks[r]) for r in sorted(run.ranks)]

    def across(key: str) -> Optional[float]:
        values = [row[key] for row in ranks if row[key] is not None]
        value = median(values)
        return None if value is None else round(value, 3)

    iteration, clean = across("iteration_time_ms"), across("clean_iteration_time_ms")
    kineto = across("kineto_iteration_time_ms")
    summary = {
        "run_dir": run.run_dir,
        "job_id": run.manifest.get("job_id"),
        "status": run.manifest.get("status"),
        "exit_code": run.manifest.get("exit_code"),
        "command": run.manifest.get("command"),
        "world_size": run.world_size,
        "ranks_recorded": sorted(run.ranks),
        "missing_ranks": run.missing_ranks,
        "iteration_time_ms": iteration,
        "clean_iteration_time_ms": clean,
        "kineto_iteration_time_ms": kineto,
        "profiler_overhead_pct": round(100.0 * (iteration / clean - 1.0), 2) if iteration and clean else None,
        "kineto_overhead_pct": round(100.0 * (kineto / clean - 1.0), 2) if kineto and clean else None,
        "ranks": ranks,
        "memory": run_memory(run),
        "problems": run.problems,
    }
    return summary


def summarize_run(run_dir: str) -> dict:
    return summarize(load_run(run_dir))


def _alignment_lines(alignment: dict) -> list[str]:
    """Clock offsets with each rank's uncertainty, and the alignment's warnings (a summary made at job end)."""
    if not alignment.get("offsets_us"):
        return []
    widths = alignment.get("uncertainty_us") or {}

    def offset(rank: str, value: float) -> str:
        width = widths.get(rank, 0.0)
        return f"{rank}: {value:+.1f}" + ("" if width == 0.0 else " (unbounded)" if width is None
                                         else f" (±{width / 2:.0f})")

    lines = [f"clock offsets (us, {alignment['method']}" + (", approximate" if alignment.get("approximate") else "")
             + "): " + ", ".join(offset(r, v) for r, v in alignment["offsets_us"].items())]
    lines += [f"alignment: {warning}" for warning in alignment.get("warnings", [])]
    return lines


def format_summary(summary: dict) -> str:
    from rich.console import Console
    from rich.table import Table

    def cell(value) -> str:
        return "-" if value is None else f"{value:.2f}"

    table = Table(title=f"dprorun summary: job {summary['job_id']} ({summary['world_size']} ranks, "
                        f"medians over the profiled window, ms)")
    columns = [("rank", "rank"), ("host", "host"), ("iteration", "iteration_time_ms"),
               ("w/o profiler", "clean_iteration_time_ms"), ("compute", "compute_ms"), ("fw", "forward_ms"),
               ("bw", "backward_ms"), ("update", "update_ms"), ("comm (ready→done)", "comm_ms"),
               ("exposed comm", "exposed_comm_ms"), ("queueing", "queue_ms"), ("idle/other", "idle_ms"),
               ("buckets", "buckets")]
    for title, _ in columns:
        table.add_column(title, justify="left" if title == "host" else "right")
    for row in summary["ranks"]:
        table.add_row(*[str(row[k]) if k in ("rank", "host", "buckets") else cell(row[k]) for _, k in columns])
    console = Console(record=True, width=140)
    with console.capture() as capture:
        console.print(table)
    lines = [capture.get().rstrip()]
    check = summary.get("self_check")
    changed = bool(check and check.get("speed_changed"))  # then no percentage is the hooks' cost

    def pct(key: str) -> str:
        return f" ({summary[key]:+.1f} %)" if summary[key] is not None and not changed else ""

    lines.append(f"iteration time (median): {cell(summary['iteration_time_ms'])} ms under the hooks, "
                 f"{cell(summary['clean_iteration_time_ms'])} ms with no profiling" + pct("profiler_overhead_pct")
                 + (f", {cell(summary['kineto_iteration_time_ms'])} ms with the profiler on" + pct("kineto_overhead_pct")
                    if summary["kineto_overhead_pct"] is not None else "")
                 + (" (no measure of the hooks' cost: the job's own speed changed after the window, below)"
                    if changed else ""))
    for row in summary.get("memory", []):
        if row["estimated_peak_bytes"] and row["measured_peak_bytes"]:
            lines.append(f"rank {row['rank']} peak memory ({row['device']}): estimated "
                         f"{row['estimated_peak_bytes'] / 2 ** 20:.1f} MiB, measured "
                         f"{row['measured_peak_bytes'] / 2 ** 20:.1f} MiB ({row['error_pct']:+.1f} %)")
    lines += _alignment_lines(summary.get("alignment") or {})
    if check:
        lines.append(check["message"])
    if summary["missing_ranks"]:
        lines.append(f"missing: no trace for ranks {summary['missing_ranks']}")
    lines += [problem for problem in summary.get("problems", []) if not problem.startswith("no trace for ranks")]
    for row in summary["ranks"]:
        for warning in row["warnings"]:
            lines.append(f"rank {row['rank']}: {_warning_line(warning)}")
    return "\n".join(lines)


def grouped_rank_warnings(summary: dict) -> list[str]:
    """The ranks' warnings, one line each, the ranks that share one named together ("ranks [0, 1]: ...")."""
    by_text: dict[str, list[int]] = {}
    for row in summary.get("ranks", []):
        for warning in row.get("warnings", []):
            by_text.setdefault(_warning_line(warning), []).append(row["rank"])
    return [f"rank {ranks[0]}: {text}" if len(ranks) == 1 else f"ranks {ranks}: {text}"
            for text, ranks in by_text.items()]


def _warning_line(warning: str) -> str:
    """A rank's warning as one line: its first, or for the script's error the line that says what failed (a
    TensorFlow error's cause comes after a header and where: procs.error_line)."""
    from dprorun.layout import SCRIPT_RAISED
    from dprorun.procs import error_line

    if warning.startswith(SCRIPT_RAISED) and "\n" in warning:
        return SCRIPT_RAISED + error_line(warning[len(SCRIPT_RAISED):])
    return warning.splitlines()[0] if warning else ""
