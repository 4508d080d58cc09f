"""Predictions: the job as it ran and what-ifs, by replaying the global DFG (`replay/synthesize.py`) once per
measured iteration; the self-check against the run's clean iterations; the optimizer's fast evaluations
(`replay_once` on the coarsened view, `sync_time_us`: the partial replay of one tensor's synchronisation).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Optional

import numpy as np

from dprorun.replay.engine import GraphBuilder, ReplayGraph, ReplayResult, critical_path_report, replay
from dprorun.replay.synthesize import synthesize
from dprorun.replay.build import build_job_model
from dprorun.replay.template import JobModel
from dprorun.replay.whatif import WhatIf, comm_scale, hook_work_us_per_byte

@dataclass
class Prediction:
    predicted_iteration_time_ms: float
    world_size: int
    buckets: int
    baseline: str
    measured_iteration_time_ms: Optional[float]
    critical_path: dict
    device_utilisation: dict
    comm_model: dict
    replay_ops: int
    replay_time_s: float
    engine: str
    whatif: dict
    notes: list[str] = field(default_factory=list)
    spread_ms: Optional[list[float]] = None  # p10, p90 over the per-iteration replays
    self_check: Optional[dict] = None  # the job as it ran: replay vs the run's clean iterations (see self_check)

    def to_json(self) -> dict:
        return asdict(self)


MIN_CLEAN_ITERATIONS = 5
MIN_WARMUP_ITERATIONS = 2  # warm-up iterations (from the third) that can say the job was still settling
LOW_OP_SCALING = 0.25  # below it (a phase profiled 4x slower than it runs) the op-level split is not backed


def _band_ms(values_us) -> tuple[float, float, float]:
    """(median, p10, p90) in ms."""
    values = np.asarray(values_us, dtype=float) / 1000
    return float(np.median(values)), float(np.percentile(values, 10)), float(np.percentile(values, 90))


AGREEMENT_LIMIT = 0.10  # a replay further than this from the clean iterations' median is never said to agree
RARE_ITERATION_FACTOR = 3.0  # a clean iteration this many times their median is a rare event's, not the spread


def regular_iterations(values_us: list[float]) -> tuple[list[float], int]:
    """The iterations the self-check's band is taken over, and how many were left out: those over
    RARE_ITERATION_FACTOR times the median (a new epoch's distributed iterator, a checkpoint saved every N steps),
    where at least MIN_CLEAN_ITERATIONS remain. Two such iterations among 9 made a 29 ms job's band 25-1413 ms,
    and any replay "agreed" with it."""
    middle = float(np.median(values_us))
    regular = [t for t in values_us if t <= RARE_ITERATION_FACTOR * middle]
    if len(regular) < MIN_CLEAN_ITERATIONS:
        return list(values_us), 0
    return regular, len(values_us) - len(regular)


def self_check(model: JobModel, as_run_replays_us) -> dict:
    """Compare the replay of the job as it ran with the run's clean iterations (no profiling, nothing of
    dprorun's running): agree when the medians differ by no more than half the run's own p10-p90 band or 2 %, and
    by no more than AGREEMENT_LIMIT: a wider band (iterations of unequal work) makes the figure "uncertain", warned.
    A difference within the replay's own band only (the profiled iterations ran unevenly, e.g. a job still
    settling) is "uncertain", warned with the difference: a wide replay band widens no tolerance. Where they
    disagree, say which one the prediction follows (the profiled window: it is what the replay is built from)
    and why, from the window's own measured iterations."""
    replay, replay_lo, replay_hi = _band_ms(as_run_replays_us)
    check = {"replay_ms": round(replay, 3), "replay_p10_p90_ms": [round(replay_lo, 3), round(replay_hi, 3)],
             "clean_iterations": len(model.clean_iterations_us)}
    if model.window_iterations_us:
        check["window_ms"] = round(_band_ms(model.window_iterations_us)[0], 3)
    if len(model.warmup_iterations_us) >= MIN_WARMUP_ITERATIONS:
        check["warmup_ms"] = round(_band_ms(model.warmup_iterations_us)[0], 3)
    if len(model.clean_iterations_us) < MIN_CLEAN_ITERATIONS:
        check.update(status="unchecked", message=(
            f"only {len(model.clean_iterations_us)} clean iteration(s) after the window (need "
            f"{MIN_CLEAN_ITERATIONS}): the replay could not be checked against the job without profiling; "
            "run more steps, or raise --clean"))
        return check
    regular, rare = regular_iterations(model.clean_iterations_us)
    clean, clean_lo, clean_hi = _band_ms(regular)
    tolerance = max((clean_hi - clean_lo) / 2, 0.02 * clean)
    difference = replay - clean
    check.update(clean_ms=round(clean, 3), clean_p10_p90_ms=[round(clean_lo, 3), round(clean_hi, 3)],
                 difference_pct=round(100 * difference / clean, 2), tolerance_ms=round(tolerance, 3),
                 clean_left_out=rare)
    measured = (f"the run's {len(regular)} clean iterations ({clean:.2f} ms, p10-p90 {clean_lo:.2f}-{clean_hi:.2f}"
                + (f"; {rare} more, over {RARE_ITERATION_FACTOR:g} times their median, left out: an epoch's start, "
                   "a checkpoint, something the job does now and then" if rare else "") + ")")
    if abs(difference) <= tolerance and abs(difference) > AGREEMENT_LIMIT * clean:
        check.update(status="uncertain", wide_clean_spread=True, message=(
            f"warning: the replay of the job as it ran ({replay:.2f} ms) differs from {measured} by "
            f"{100 * difference / clean:+.1f} %, within the run's own spread only (±{100 * tolerance / clean:.0f} %): "
            "its iterations without profiling vary that much (steps of unequal work, e.g. an optimizer step skipped "
            "or a second forward now and then, or other load then), so its figures are uncertain by about that much"))
    elif abs(difference) <= tolerance:
        check.update(status="agrees", message=(
            f"self-check: the replay of the job as it ran ({replay:.2f} ms) agrees with {measured}: "
            f"{100 * difference / clean:+.1f} %"))
    elif abs(difference) <= (replay_hi - replay_lo) / 2:
        check.update(status="uncertain", message=(
            f"warning: the replay of the job as it ran ({replay:.2f} ms) differs from {measured} by "
            f"{100 * difference / clean:+.1f} %, more than the run's own spread (±{tolerance:.2f} ms) but within the "
            f"replay's, from one profiled iteration to the next ({replay_lo:.2f}-{replay_hi:.2f} ms): the profiled "
            "window ran unevenly (a job still settling, or other load then), so its predictions are uncertain by "
            f"about ±{50 * (replay_hi - replay_lo) / replay:.0f} %; profile a later window (--warmup) or more "
            "iterations for a tight figure"))
    else:
        check.update(status="disagrees", message=(
            f"warning: the replay of the job as it ran ({replay:.2f} ms) differs from {measured} by "
            f"{100 * difference / clean:+.1f} %, more than the run's own spread (±{tolerance:.2f} ms); the "
            "prediction follows the profiled window, from which it is built: "
            + _why_disagrees(check, replay, tolerance)))
    return check


def _why_disagrees(check: dict, replay_ms: float, tolerance_ms: float) -> str:
    """Why the replay of the job as it ran misses the clean iterations, from the window's own iterations and the
    warm-up's before it (no profiling then either: where they ran as the window did and not as the clean ones, the
    job's own speed changed between the window and the clean iterations)."""
    window, warmup, clean = check.get("window_ms"), check.get("warmup_ms"), check.get("clean_ms")
    if warmup is not None and clean is not None and abs(warmup - clean) > tolerance_ms \
            and abs(warmup - replay_ms) < abs(warmup - clean):
        check["speed_changed"] = True  # the window against the clean iterations is then no measure of the hooks' cost
        at_window = f", the window's at {window:.2f} ms" if window is not None else ""
        return (f"the job's own speed changed after the window: its warm-up iterations, before any profiling, ran at "
                f"{warmup:.2f} ms{at_window}, its clean iterations at {clean:.2f} ms (a job still settling, or "
                "other load then); profile a later window (--warmup) for a figure of the job as it runs now")
    if window is not None and abs(replay_ms - window) <= tolerance_ms:
        return (f"the window's own iterations ran at {window:.2f} ms: the job ran at another speed under the hooks "
                "than without them (their cost, or what else ran on the machine then)")
    return (f"the replay also misses the window's own iterations ({window:.2f} ms): a modelling error"
            if window is not None else "the window's iterations were not measured")


REPLAY_BUDGET_RANK_ITERATIONS = 2048  # per prediction: ranks x replayed iterations, for large runs

MIN_REPLAYED_ITERATIONS = 5


def replayed_samples(model: JobModel, notes: list[str]) -> list:
    """The measured iterations a prediction replays: all of them, or on a large run an even subset (at least 5)
    within REPLAY_BUDGET_RANK_ITERATIONS, said in the notes."""
    samples = model.samples or [None]
    keep = max(MIN_REPLAYED_ITERATIONS, REPLAY_BUDGET_RANK_ITERATIONS // max(1, len(model.templates)))
    if len(samples) <= keep:
        return samples
    chosen = [samples[round(k * (len(samples) - 1) / (keep - 1))] for k in range(keep)]
    notes.append(f"{keep} of the {len(samples)} measured iterations replayed (evenly spaced; a run of "
                 f"{len(model.templates)} measured ranks)")
    return chosen


def predict(model: JobModel, whatif: Optional[WhatIf] = None, detail: str = "ops") -> Prediction:
    """Replay every measured iteration (each with its own durations) and report the median prediction: the
    slowest rank differs from iteration to iteration, which a replay of averaged durations misses."""
    return predict_replayed(model, whatif, detail)[0]


def predict_replayed(model: JobModel, whatif: Optional[WhatIf] = None,
                     detail: str = "ops") -> tuple[Prediction, ReplayGraph, ReplayResult]:
    """`predict`, plus the graph and the replay whose critical path the prediction reports (the median
    iteration's; with an even count of iterations the predicted time averages the middle two): for the
    execution graph and the replayed timeline (engine.execution_graph, engine.replay_chrome_trace)."""
    whatif = whatif or WhatIf()
    notes = list(model.notes)
    samples = replayed_samples(model, notes)
    runs = []
    for sample in samples:
        graph = synthesize(model, whatif, notes if sample is samples[0] else [], sample, detail=detail)
        runs.append((replay(graph), graph))
    times = np.array([result.iteration_time_us for result, _ in runs])
    chosen = int(np.argsort(times)[len(times) // 2])
    result, graph = runs[chosen]
    path = critical_path_report(graph, result)
    measured = np.median([t.measured_iteration_us for t in model.templates.values()]) / 1000
    notes += _detail_notes(model, detail)
    if whatif.is_identity():
        notes.append("the job as it ran: measured buckets and transmission times, profiled iterations without "
                     "the profiler" + (" (their compute; TensorFlow: see above)" if model.framework == "tf" else ""))
    elif model.transport and model.transport["shares_cores"] and whatif.changes_communication():
        t = model.transport
        beside = [row for row in t.get("allreduce_idle_vs_beside_compute_us") or [] if row[0] == 1 << 20]
        slowed = (f"; a 1 MiB all-reduce took {beside[0][2] / 1000:.1f} ms beside compute vs "
                  f"{beside[0][1] / 1000:.1f} ms idle") if beside else ""
        notes.append(f"caution: the transport runs on the cores the ranks compute on ({t['cores_per_rank']:g} "
                     f"core(s) per rank, {t['compute_threads']} compute thread(s); its all-reduces kept it busy "
                     f"{100 * t['transport_cpu_share']:.0f} % of their time{slowed}), while the replay gives "
                     "communication devices of its own: more collectives cost more and overlap gains less than "
                     "predicted here")
    if graph.meta["ranks_built"] < graph.meta["world_size"]:
        built = graph.meta["ranks_built"]
        notes.append(f"the ring of {graph.meta['world_size']} ranks repeats every {built} ranks (they cycle "
                     f"through the measured ones): {built} built, exactly equivalent; "
                     "utilisation and critical path are shown for those")
    if len(runs) > 1:
        notes.append(f"median of {len(runs)} replays, one per measured iteration (p10-p90 "
                     f"{np.percentile(times, 10) / 1000:.2f}-{np.percentile(times, 90) / 1000:.2f} ms)")
    utilisation = result.device_utilisation()
    check = self_check(model, times) if whatif.is_identity() and whatif.baseline != "daydream" else None
    if check is not None and check["status"] != "agrees":
        notes.append(check["message"])
    return (Prediction(
        predicted_iteration_time_ms=round(float(np.median(times)) / 1000, 4),
        world_size=graph.meta["world_size"], buckets=graph.meta["buckets"], baseline=whatif.baseline,
        measured_iteration_time_ms=round(float(measured), 4) if whatif.is_identity() else None,
        critical_path={k: v for k, v in path.items() if k != "path"},
        device_utilisation={k: round(v, 4) for k, v in sorted(utilisation.items())[:64]},
        comm_model=dict(model.comm.to_json(), transport=model.transport), replay_ops=graph.size,
        replay_time_s=round(sum(r.replay_time_s for r, _ in runs), 4),
        engine=result.engine, whatif={k: v for k, v in asdict(whatif).items() if k != "buckets"}, notes=notes,
        spread_ms=[round(float(np.percentile(times, 10)) / 1000, 4), round(float(np.percentile(times, 90)) / 1000, 4)],
        self_check=check),
        graph, result)


def _detail_notes(model: JobModel, detail: str) -> list[str]:
    """What the compute nodes of the replayed graph are, and a warning where the profiler slowed a phase so
    much that the op-level split of its time is not backed."""
    if not model.op_profiles:
        return ["compute replayed as phases (no profiler ops in this run)"]
    counts = sorted(p.op_count for p in model.op_profiles.values())
    scaled = ", ".join(f"{phase} x{ratio:.2f}" for phase, ratio in model.op_scaling.items()
                       if phase in ("forward", "backward", "update"))
    if detail == "coarse":
        return [f"compute replayed as phases (the coarsened view of {counts[len(counts) // 2]} profiled ops per rank)"]
    notes = [f"op level: {counts[len(counts) // 2]} profiled ops per rank (median), scaled phase by phase to the "
             f"iterations without the profiler ({scaled})"]
    inflated = [f"the {phase} {1 / ratio:.1f}x" for phase, ratio in model.op_scaling.items()
                if phase in ("forward", "backward", "update") and 0 < ratio < LOW_OP_SCALING]
    if inflated:  # or the work changed after the profiled iterations (a trunk frozen in the window: x0.07)
        notes.append(f"warning: the profiler slowed {', '.join(inflated)}, or the work changed after the profiled "
                     "iterations (layers frozen, shorter inputs): the op-level split of that time (the critical "
                     "path's ops, the timeline) is uncertain; the phases' totals, and so the prediction, come from "
                     "the iterations without the profiler")
    return notes


def replay_once(model: JobModel, whatif: WhatIf, detail: str = "coarse") -> tuple[float, dict]:
    """One replay of the median durations (the optimizer's fast evaluation, on the coarsened view by default):
    iteration time in µs and the critical-path report."""
    graph = synthesize(model, whatif, [], detail=detail)
    result = replay(graph)
    return result.iteration_time_us, critical_path_report(graph, result)


def representative(model: JobModel) -> JobModel:
    """The model with every rank alike: the measured rank with the longest iteration stands for all (a
    synchronous job runs at its slowest rank's pace): its replay builds a single rank (see `synthesize`)."""
    slowest = max(model.templates, key=lambda r: model.templates[r].measured_iteration_us)
    return replace(model, templates={slowest: model.templates[slowest]}, samples=[])


def sync_time_us(model: JobModel, nbytes: int, world: Optional[int] = None, partitions: int = 1) -> float:
    """Partial replay: the time to synchronise one tensor of `nbytes` over `world` ranks split into
    `partitions` pieces, with nothing else in the graph (the optimizer's t_sync(s, k)); default: the ranks one of
    the job's all-reduces spans (its ring: the world, or the script's own DDP groups). Every rank is alike
    here, so only rank 0 is built and each step receives what rank 0 itself sends (see `synthesize`)."""
    world = world or model.ring_size
    if world <= 1:
        return 0.0
    g = GraphBuilder()
    scale = comm_scale(model)
    steps = 2 * (world - 1)
    # a comm hook's own work (PowerSGD's factorising) per step, with the latency: no link's
    latency = scale * model.comm.step_latency_us(world) + hook_work_us_per_byte(model) * nbytes / partitions / steps
    wire = scale * nbytes / partitions / (world * model.comm.bandwidth_bytes_per_us)
    if model.channels == 1:  # one collective at a time: latency and bytes on the link, in order
        wire, latency = wire + latency, 0.0
    start = g.op("r0.In", "VIRTUAL", 0, None, 0.0)
    end = g.op("r0.Out", "VIRTUAL", 0, None, 0.0)
    for p in range(partitions):
        previous = [start]
        for s in range(2 * (world - 1)):
            lat = g.op(f"r0.latency.p{p}.s{s}", "COMM", 0, "channel0", latency, capacity=model.channels)
            for u in previous:
                g.edge(u, lat)
            send = g.op(f"r0.send.p{p}.s{s}", "COMM", 0, "link0", wire)
            g.edge(lat, send)
            recv = g.op(f"r0.recv.p{p}.s{s}", "VIRTUAL", 0, None, 0.0)
            g.edge(send, recv)  # what the left neighbour sends in this step, at the same moment
            previous = [send, recv]
        for u in previous:
            g.edge(u, end)
    return replay(g.build(), use_fast=False).iteration_time_us


def predict_run(run, whatif: Optional[WhatIf] = None) -> Prediction:
    return predict(build_job_model(run), whatif)
