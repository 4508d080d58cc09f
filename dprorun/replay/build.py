"""Building the job model from an aligned RunTrace: every rank's templates (measure.measure_rank), the buckets, the
communication cost model (calibration, trace, Horovod's own), the measured iterations as samples, and, for
TensorFlow workers, the profiled steps' templates scaled to the steps that ran without the profiler (for
horovod.tensorflow, and TensorFlow where the closed form misses, fitted by replaying them: the one part of building
that replays, hence a module of its own above synthesize)."""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

import numpy as np

from dprorun.graph.local import blocking_collectives, op_profile
from dprorun.replay.engine import replay
from dprorun.replay.measure import enqueues_over_ranks, iteration_slots, measure_rank
from dprorun.replay.synthesize import synthesize
from dprorun.replay.template import LATENCY_BOUND, BucketInfo, CommModel, JobModel, MeasuredIteration, RankTemplate, \
    _horovod_timeline_points, _ready_fractions, comm_channels, fit_comm_model, horovod_comm_model, horovod_knobs_as_run, \
    message_latency_us, ring_bytes, ring_size, transport_on_compute_cores
from dprorun.replay.whatif import WhatIf
from dprorun.stats import median
from dprorun.trace.model import RankTrace, RunTrace, ddp_groups, is_tf_tracker


def _script_comm_hook(trace: RankTrace, buckets: list[BucketInfo]) -> tuple[str, str]:
    """(the script's own DDP comm hook's name, "" if none; why its bucket layout must stay, "" if it may change:
    PowerSGD on gloo, or buckets of a second DDP module, which whatif.plan_syncs does not re-bucket)."""
    hooked = [t for t in trace.meta.get("trackers", []) if t.get("user_comm_hook")]
    name = (hooked[0].get("user_comm_hook_name") or "a comm hook") if hooked else ""
    if any("powerSGD" in (t.get("user_comm_hook_name") or "") and t.get("backend") == "gloo" for t in hooked):
        return name, ("the script's PowerSGD hook on gloo: with more than one bucket its chained all-reduces "
                      "mismatch across ranks and gloo aborts the job (plain torchrun alike)")
    if any(b.key.startswith("ddp") for b in buckets):
        return name, "the buckets replayed are a second DDP module's"
    return name, ""


def _synchronised(buckets: list[BucketInfo], templates: dict[int, RankTemplate],
                  samples: Optional[dict[int, dict[int, RankTemplate]]] = None) -> tuple[list[BucketInfo], list[str]]:
    """The buckets every rank synchronised in its measured iteration (its template's ready order) or in any of its
    replayed iterations (`samples`), and a note naming the others. Each replayed iteration hands over those of them
    it has (replay/synthesize.py): a layer skipped at random (LayerDrop, its gradients all-reduced by hand where
    they exist) is replayed in the iterations that ran it, where only the most common set of buckets was before (a
    block run in 4 of 11 iterations lost its all-reduces in all: -17 %); a second DDP module stepped now and then (a
    WGAN-GP's generator) likewise."""
    def handed_over(r: int) -> set[str]:
        return set().union(*(set(t.forward_order + t.bucket_ready_order + t.gathered)
                             for t in [templates[r], *(samples or {}).get(r, {}).values()]))

    seen = set.intersection(*(handed_over(r) for r in templates)) if templates else set()
    kept = [b for b in buckets if b.key in seen] if seen else buckets
    left = [b.key for b in buckets if b not in kept]
    if not left:
        return buckets, []
    return kept, [f"{', '.join(left)} synchronised in only some of the window's iterations (a model stepped now "
                  "and then, as a GAN's generator every few steps; layers skipped in some steps): not replayed, nor "
                  "their all-reduces in the iterations where they ran"]


def _ddp_groups_note(model: JobModel) -> str:
    return (f"the script's DDP all-reduces within process groups of its own ({model.ddp_groups_text()}), not "
            f"across the job's {model.world_size} ranks: each group's buckets are replayed as a ring of its own "
            "ranks; a world-size what-if is not answered (the script forms the groups)")


def _horovod_costs(model: JobModel, run: RunTrace, calibration: list) -> None:
    """A Horovod job's knobs as run and its communication costs (template.horovod_comm_model), with a warning
    where the calibration could not price the bytes."""
    model.framework = "horovod"
    model.horovod_knobs = horovod_knobs_as_run(run.manifest.get("horovod_args") or [])
    fitted = horovod_comm_model(calibration, _horovod_timeline_points(run), model.world_size,
                                model.horovod_knobs[1])
    if fitted is not None:
        model.comm, model.horovod_negotiation_us = fitted
    model.dtype_cost = _horovod_dtype_costs(run, sorted(run.ranks))
    if model.dtype_cost:
        model.notes.append("Horovod responses in " + ", ".join(
            f"{dtype} priced at x{cost:.2f} their bytes" for dtype, cost in sorted(model.dtype_cost.items())) +
            " in modelled what-ifs: the calibration's calls in that dtype took that much longer than float32 ones "
            "of the same bytes on the job's own network (gloo sums float16 in software); at another bandwidth that "
            "share is not measured (2.0 x on loopback here, 1.04-1.07 x at 1 Gbit/s, where it is not applied)")
    calls = ", ".join(f"{int(p[0])} B {p[1] / 1e3:.1f} ms" for p in calibration)
    if model.comm.source == LATENCY_BOUND:
        model.notes.append(f"warning: Horovod's calibration calls did not grow with their bytes beyond their scatter "
                           f"({calls}): each response is priced at their median, and the bandwidth is a bound from "
                           "their spread, not a measure (expect what-ifs on bandwidth or bytes to be rough)")
    if len(calibration) >= 2 and model.comm.source.startswith("horovod timeline"):
        model.notes.append(f"warning: Horovod's calibration did not fit a line growing with size ({calls}): "
                           "communication is priced from the timeline's fused responses, which include waiting for "
                           "the other ranks (expect modelled what-ifs to overrate communication)")


DTYPE_COST_MIN = 0.10  # a dtype's measured time a byte this far from float32's (either way) is priced as measured


def _horovod_dtype_costs(run: RunTrace, ranks: list[int]) -> dict[str, float]:
    """Per wire dtype other than float32 (a float16 trunk's gradients, or all of them under
    hvd.Compression.fp16), its calibration calls' time over float32 calls of the same bytes, timed in turns
    (runtime/calibration.calibrate_horovod_dtypes; the median over ranks), where it differs by more than
    DTYPE_COST_MIN: gloo sums float16 in software, which the float32 calibration cannot see."""
    ratios: dict[str, list[float]] = {}
    for r in ranks:
        for dtype, _, us, float32_us in run.ranks[r].meta.get("calibration_dtypes", []):
            if us > 0 and float32_us > 0:
                ratios.setdefault(dtype, []).append(us / float32_us)
    costs = {dtype: float(np.median(values)) for dtype, values in ratios.items()}
    return {dtype: round(cost, 3) for dtype, cost in costs.items() if abs(cost - 1) > DTYPE_COST_MIN}


SCRIPT_ALL_REDUCES = "the gradients are all-reduced by the script's own calls"
INFERRED_UPDATE_NOTE = ("no torch.optim optimizer stepped (an optimizer of the script's own, or an update by "
                        "hand): each iteration's update is read as the time from its backward's last all-reduce to "
                        "the next iteration (the update, zero_grad and the next input together)")


FSDP_BLOCKING = ("FSDP on the CPU: its {calls} calls a step ({gathers} all-gathers of the parameters, in the forward "
                 "and again in the backward, {scatters} reduce-scatters of the gradients{replicas}) each held the "
                 "rank's thread, so nothing overlapped them: each replayed where it was called, the compute after it "
                 "waiting for it, priced as the all-reduce that sends the same bytes on the ring (half its own); at "
                 "another world size the compute and the update are kept as measured (each rank's shard, and so its "
                 "update, shrinks with more ranks: not modelled)")


def _script_all_reduces(model: JobModel, trackers: list[dict]) -> None:
    """Gradients all-reduced by the script's own calls (runtime/collectives.py): its buckets are its calls, which
    dprorun cannot change (the optimizer leaves them; re-bucketing what-ifs answer what fusing them, or a
    DistributedDataParallel of the model, would give)."""
    model.framework = "collectives"
    calls = len(model.buckets)
    kinds = sorted({b.collective for b in model.buckets})
    library = "horovod.torch" if any(t.get("backend") == "horovod" for t in trackers) else "torch.distributed"
    model.script_calls_library = library
    model.bucket_layout_fixed = (f"the script's own {library}.{' / '.join(kinds)} calls ({calls} a step) "
                                 "send the gradients: dprorun cannot change them")
    if any(t.get("blocking") for t in trackers):
        model.blocking_collectives = True
        model.fsdp_subgroup_sizes = sorted({n for t in trackers for n in t.get("fsdp_subgroup_sizes") or []})
        model.bucket_layout_fixed = (f"FSDP's own all_gather / reduce_scatter calls ({calls} a step): dprorun "
                                     "cannot change them")
        reduces = sum(b.collective == "all_reduce" for b in model.buckets)
        model.notes.append(FSDP_BLOCKING.format(calls=calls, **_gathers_and_scatters(model), replicas=(
            f", {reduces} all-reduces across its replicas (HSDP)" if reduces else "")))
        return
    model.notes.append(f"{SCRIPT_ALL_REDUCES} ({calls} a step), each replayed as one bucket")
    compressed = sum(b.gathers_gradients for b in model.buckets)
    if compressed:
        model.notes.append(f"its gradients are compressed by hand: {compressed} all-gather(s) of each rank's share "
                           "(top-k values or indices) between the backward and the step, each priced as the "
                           "all-reduce that sends the same bytes on the ring (half its own); at another world size "
                           "their bytes grow with the ranks (each rank's share as measured)")
    elif model.sharded_buckets():
        counts = _gathers_and_scatters(model)
        model.notes.append(f"its optimizer is sharded by hand (ZeRO): {counts['scatters']} reduce-scatter(s) of the "
                           f"gradients before the step, {counts['gathers']} all-gather(s) of the parameters after it; "
                           "each priced as the all-reduce that sends the same bytes on the ring (half its own), its "
                           "ring messages counted twice (the N-1 extra messages' latency over)")


def _gathers_and_scatters(model: JobModel) -> dict[str, int]:
    return {"gathers": sum(b.collective == "all_gather" for b in model.buckets),
            "scatters": sum(b.collective == "reduce_scatter" for b in model.buckets)}


def _transmit_over_ranks(run: RunTrace, transmit: dict[str, list[float]],
                         per_iteration_tx: dict[int, dict[str, list[float]]]) -> tuple[dict[str, list[float]],
                                                                                       dict[int, dict[str, float]]]:
    """Each bucket's transmission times (its median, the comm model's fit) and, per iteration, the one its replay
    takes: the ranks' mean; for collectives that block each rank (FSDP on the CPU) the last rank's, since the chain
    goes on only when every rank is back (the next call meets them all again; the ranks' returns from one gloo
    gather were 0.2-0.6 ms apart on a 2-rank FSDP MLP, and their mean replayed the window 5.6 % short)."""
    if not any(blocking_collectives(trace) for trace in run.ranks.values()):
        return transmit, {i: {key: float(np.mean(v)) for key, v in by_key.items()}
                          for i, by_key in per_iteration_tx.items()}
    last = {i: {key: float(np.max(v)) for key, v in by_key.items()} for i, by_key in per_iteration_tx.items()}
    over: dict[str, list[float]] = {}
    for by_key in last.values():
        for key, value in by_key.items():
            over.setdefault(key, []).append(value)
    return over, last


def build_job_model(run: RunTrace) -> JobModel:
    """Measure templates, buckets and the comm model from an aligned RunTrace."""
    ranks = sorted(run.ranks)
    world = run.world_size
    iterations = {r: run.ranks[r].unprofiled_window_iterations() for r in ranks}
    tf_job = is_tf_run(run)
    if tf_job:  # only the profiled steps have phases (from the TensorFlow profile): measured there, scaled below
        iterations = {r: tf_profiled_steps(run.ranks[r]) for r in ranks}
    slots = {r: iteration_slots(run.ranks[r], iterations[r]) for r in ranks}
    hand_overs = enqueues_over_ranks(slots)
    channels = comm_channels(run)
    templates, per_rank_samples, transmit = {}, {}, {}
    per_iteration_tx: dict[int, dict[str, list[float]]] = {}
    for r in ranks:
        templates[r], per_rank_samples[r], tx = measure_rank(run.ranks[r], iterations[r], hand_overs, channels,
                                                             slots[r])
        for i, buckets_tx in tx.items():
            for key, value in buckets_tx.items():
                transmit.setdefault(key, []).append(value)
                per_iteration_tx.setdefault(i, {}).setdefault(key, []).append(value)
    common = sorted(set.intersection(*(set(per_rank_samples[r]) for r in ranks)))
    transmit, per_iteration = _transmit_over_ranks(run, transmit, per_iteration_tx)
    samples = [MeasuredIteration({r: per_rank_samples[r][i] for r in ranks}, per_iteration.get(i, {})) for i in common]
    first = run.ranks[ranks[0]]
    buckets, skipped = _synchronised(
        [BucketInfo(b.key, ring_bytes(b), list(b.params), median(transmit.get(b.key, []), 0.0), sparse=b.sparse,
                    wire_ratio=b.nbytes / b.buffer_nbytes if b.buffer_nbytes else 1.0, hook_work=b.hook_work,
                    collective=b.collective, dtype=b.dtype, gathers_gradients=b.gathers_gradients,
                    pack_call=b.pack_call)
         for b in first.buckets], templates, per_rank_samples)
    # ring all-reduces (not a hook's own work: PowerSGD's 128 KB took 10-25 ms of factorising on 2 CPU cores)
    points = [(b.nbytes, t) for b in buckets if not b.sparse and not b.hook_work for t in transmit.get(b.key, [])]
    calibration = [tuple(p) for p in first.meta.get("calibration", [])]
    latency = message_latency_us(run)
    groups = ddp_groups(run)  # the buckets' rings: the script's own groups where it has some (the calibration's: all)
    ring = ring_size(groups, world)
    comm = fit_comm_model(points, ring, calibration, latency) if ring > 1 else ONE_RANK_COMM
    network = fit_comm_model(calibration, world, [], latency) if len(calibration) >= 2 else None
    if network is not None:  # the calibration alone must fit a line (points enough, growing with size)
        network = replace(network, source="calibration") if network.source == "trace" else None
    fractions = _ready_fractions(run)
    model = JobModel(world, templates, buckets, dict(first.param_bytes), fractions, comm,
                     first.meta.get("bucket_cap_mb"), channels=channels, samples=samples, network=network,
                     compute_variants=dict(first.meta.get("compute_variants") or {}), ddp_groups=groups,
                     transport=transport_on_compute_cores(run),
                     collectives_outside_packs=_collectives_outside_packs(run, ranks))  # TF's: read again below
    model.script_comm_hook, model.bucket_layout_fixed = _script_comm_hook(first, model.buckets)
    ddp_trackers = [t for t in first.meta.get("trackers", []) if "ddp" in t]
    model.ddp_buffer_bytes = max((int(t.get("broadcast_buffer_bytes") or 0) for t in ddp_trackers), default=0)
    model.ddp_buffer_owners = sorted({name for t in ddp_trackers for name in t.get("broadcast_buffer_owners") or []})
    model.notes += ([_ddp_groups_note(model)] if model.ddp_groups else []) + skipped
    model.clean_iterations_us = _median_over_ranks(run, {r: run.ranks[r].meta.get("clean_iterations", [])
                                                          for r in ranks})
    model.window_iterations_us = _median_over_ranks(run, iterations)
    model.warmup_iterations_us = _median_over_ranks(run, {r: _warmup_iterations(run.ranks[r]) for r in ranks})
    if any(t.get("framework") == "horovod" for t in first.meta.get("trackers", [])):
        _horovod_costs(model, run, calibration)
    if any(t.get("framework") == "collectives" for t in first.meta.get("trackers", [])):
        _script_all_reduces(model, first.meta.get("trackers", []))
    if not fractions:
        model.notes.append("no per-parameter gradient-ready times: re-bucketing what-ifs are unavailable")
    if any(run.ranks[r].meta.get("inferred_update") for r in ranks):
        model.notes.append(INFERRED_UPDATE_NOTE)
    if tf_job and model.framework == "horovod":
        model.notes.append("warning: horovod.tensorflow: the job ran in Horovod's dynamic timeline mode, which its "
                           "all-reduce spans need; that mode alone made plain horovodrun jobs here 14-20 % slower, and "
                           "the prediction describes the job as it ran with it (expect the job without dprorun to be "
                           "faster)")
    if tf_job:
        if model.framework != "horovod":  # horovod.tensorflow keeps Horovod's fusion and its fitted cost model
            model.framework = "tf"
            if network is not None:  # the profiled collectives ran under the profiler: the calibration prices them
                model.comm = network
        _calibrate_tf(model, run)
    model.op_profiles = {r: p for r in ranks if (p := op_profile(run.ranks[r])) is not None}
    model.op_scaling = _op_scaling(model)
    return model


def is_tf_run(run: RunTrace) -> bool:
    return any(is_tf_tracker(t) for trace in run.ranks.values() for t in trace.meta.get("trackers", []))


def tf_profiled_steps(trace: RankTrace) -> list[int]:
    """A TensorFlow worker's profiled steps (the first left out when there are others: it holds the profiler's
    start, over a second on this machine)."""
    steps = list(trace.meta.get("kineto_iterations", []))
    return steps[1:] if len(steps) > 1 else steps


def _compute_us(t: RankTemplate) -> float:
    return (t.accumulate_us + t.forward_us + t.loss_us + sum(t.backward_segments_us) + t.finalize_us + t.update_us
            + t.tail_us)


def _scaled(t: RankTemplate, k: float, measured_us: float) -> RankTemplate:
    return replace(t, accumulate_us=t.accumulate_us * k, forward_us=t.forward_us * k, loss_us=t.loss_us * k,
                   backward_segments_us=[x * k for x in t.backward_segments_us], backward_us=t.backward_us * k,
                   update_us=t.update_us * k, tail_us=t.tail_us * k, finalize_us=t.finalize_us * k,
                   measured_iteration_us=measured_us, iterations_used=1)


def _calibrate_tf(model: JobModel, run: RunTrace) -> None:
    """TensorFlow: the steps without the profiler record only their length S. Each becomes a sample: the rank's
    profiled template with its compute scaled by k = (S - E) / C (C its compute, E its exposed communication,
    medians over the profiled steps), the collectives as profiled. The replay of the job as it ran then follows
    the unprofiled steps by construction; what-ifs change what the profile measured."""
    ranks = sorted(model.templates)
    unprofiled = {r: dict((i, e - s) for i, s, e in run.ranks[r].iterations
                          if i in set(run.ranks[r].unprofiled_window_iterations())) for r in ranks}
    exposed = {r: max(0.0, model.templates[r].measured_iteration_us - _compute_us(model.templates[r])) for r in ranks}
    common = sorted(set.intersection(*(set(unprofiled[r]) for r in ranks)))
    slowed = _cap_tf_transmit(model) if model.framework == "tf" else 0.0
    exposed = {r: max(0.0, e - slowed) for r, e in exposed.items()}
    transmit = {b.key: b.transmit_us for b in model.buckets}
    factors = []
    samples = []
    for i in common:
        templates = {}
        for r in ranks:
            k = max(0.05, (unprofiled[r][i] - exposed[r]) / max(_compute_us(model.templates[r]), 1.0))
            factors.append(k)
            templates[r] = _scaled(model.templates[r], k, unprofiled[r][i])
        samples.append(MeasuredIteration(templates, dict(transmit)))
    if not samples:
        model.notes.append("TensorFlow: no step without the profiler in the window; the replay is the profiled steps'")
        return
    if model.framework == "horovod":  # horovod.tensorflow: see _fit_replayed_compute
        profiled = dict(model.templates)
        samples, factors = _fit_replayed_compute(model, profiled, samples, HOROVOD_TF_FIT)
    elif (miss := _closed_form_miss(model, samples)) is not None:
        profiled = dict(model.templates)
        samples, factors = _fit_replayed_compute(model, profiled, samples, TF_FIT.format(miss=100 * miss))
    k_median = median(factors, 1.0)
    model.templates = {r: _scaled(model.templates[r], k_median, median(list(unprofiled[r].values()), 0.0))
                       for r in ranks}
    model.samples = samples
    model.window_iterations_us = _median_over_ranks(run, {r: list(unprofiled[r]) for r in ranks})
    model.notes.append(f"TensorFlow: phases and collectives from the profiled steps; compute scaled to the "
                       f"{len(samples)} steps without the profiler (x{k_median:.2f} median), collectives as profiled")
    model.collectives_outside_packs = _collectives_outside_packs(run, ranks)


def _cap_tf_transmit(model: JobModel) -> float:
    """The packs' all-reduces as the model takes them: as profiled, but no longer than the calibration (the same
    collective timed without the profiler, nothing beside it) prices their bytes; returns the time a profiled step
    loses that way (a pack's all-reduce runs once every gradient is packed: exposed). TensorFlow's profiler slows
    the all-reduces more than the compute: a 5.3 MB pack took 37-80 ms under it where the calibration prices 32 ms
    and whole unprofiled steps took 27-40 ms; as profiled it left no time for compute (the factor at its x0.05
    floor, the replay 93 % over the clean steps, what-ifs pricing every pack 1.7x the calibration's). A 25.7 MB
    pack: 84 ms profiled, 57 ms priced, the step's compute factor x0.14 -> x0.65, its compute then 33 ms a step
    against 35 ms measured alone on one core (x0.14: 7 ms)."""
    if not model.comm.source.startswith("calibration"):
        return 0.0
    profiled = sum(b.transmit_us for b in model.buckets)
    model.buckets = [replace(b, transmit_us=min(b.transmit_us, model.comm.allreduce_us(b.nbytes, model.world_size)))
                     for b in model.buckets]
    capped = sum(b.transmit_us for b in model.buckets)
    if profiled > 1.1 * capped:
        model.notes.append(f"TensorFlow: the packs' all-reduces took {profiled / 1000:.1f} ms a profiled step, the "
                           f"calibration prices their bytes at {capped / 1000:.1f} ms without the profiler: the model "
                           "takes the calibration's")
    return profiled - capped


def _collectives_outside_packs(run: RunTrace, ranks: list[int]) -> tuple[list[str], float]:
    """The steps' collectives that all-reduce no pack or bucket (a TensorFlow worker's profiled steps,
    trace/tf_records.add_tf_records; the collectives a torch script called itself in the window,
    trace/rundir.script_collectives): their names, every rank's, and the median over ranks of each rank's median
    time in them a step."""
    names: list[str] = []
    per_rank = []
    for r in ranks:
        steps = run.ranks[r].meta.get("window", {}).get("collectives_outside_packs") or []
        if steps:
            per_rank.append(median([float(s["us"]) for s in steps], 0.0))
            names += [name for name in steps[0]["names"] if name not in names]  # each rank's (a send, its recv)
    return names, median(per_rank, 0.0)


# a job profiled on one rank: its all-reduces crossed no network (DDP copies a lone rank's gradients, the trace's
# "bandwidth" some TB/s), so what another world size needs of the link is assumed, and said (replay/comm.py)
ONE_RANK_COMM = CommModel(50.0, 125.0, "assumed (one rank profiled: no collective crossed a network): 1 Gbit/s, "
                          "50 µs a message", [])


FIT_ROUNDS = 8


HOROVOD_TF_FIT = ("horovod.tensorflow: each step's compute factor fitted so that its replay lasts the step (the "
                  "profiled steps' exposed communication does not carry over)")
TF_FIT = ("TensorFlow: each step's compute factor fitted so that its replay lasts the step: scaled by the profiled "
          "steps' exposed time, the replay missed the unprofiled steps by {miss:+.1f} % (the profiled steps held "
          "time in neither an op nor a collective, the profiler's own, that the unprofiled ones did not)")
TF_CLOSED_FORM_MISS = 0.08  # the closed-form compute factor's replay this far off the unprofiled steps: fitted


def _closed_form_miss(model: JobModel, samples: list[MeasuredIteration]) -> Optional[float]:
    """TensorFlow: k = (S - E) / C takes the profiled steps' exposed time E as the unprofiled steps' too. Where the
    profiler held time that is neither an op nor a collective (a loop run in a thread of the script's: profiled
    steps of 34.8 ms, 14.8 ms of ops and an 8.9 ms all-reduce, against 29.4 ms unprofiled), k came out x0.68 and the
    replay 30 % short of the steps it was built to follow. The median of the samples' coarse replays against the
    median step: the relative miss where beyond TF_CLOSED_FORM_MISS, else None."""
    replayed = [replay(synthesize(model, WhatIf(), [], sample, detail="coarse")).iteration_time_us for sample in samples]
    target = median([median([t.measured_iteration_us for t in sample.templates.values()], 0.0) for sample in samples],
                    0.0)
    miss = median(replayed, 0.0) / target - 1 if target > 0 else 0.0
    return miss if abs(miss) > TF_CLOSED_FORM_MISS else None


def _fit_replayed_compute(model: JobModel, profiled: dict[int, RankTemplate], samples: list[MeasuredIteration],
                          note: str) -> tuple[list[MeasuredIteration], list[float]]:
    """horovod.tensorflow: the profiled steps' exposed communication is no measure of the unprofiled steps' (under
    TensorFlow's profiler one worker lags the other, and the early one's all-reduces wait for it), so the factor
    (S - E) / C can come out far too small (x0.2 on a 2-core MLP, the replay then 25 % over the step). Instead each
    unprofiled step's compute factor k is the one whose replay (coarse graph, collectives as profiled) lasts that
    step's length S: R(k) grows with k, found by bisection on [0.05, 3] in FIT_ROUNDS replays."""
    fitted, factors = [], []
    for sample in samples:
        lengths = {r: t.measured_iteration_us for r, t in sample.templates.items()}
        target = median(list(lengths.values()), 0.0)

        def replayed(k: float) -> float:
            scaled = MeasuredIteration({r: _scaled(profiled[r], k, lengths[r]) for r in profiled},
                                       sample.transmit_us)
            return replay(synthesize(model, WhatIf(), [], scaled, detail="coarse")).iteration_time_us

        low, high = 0.05, 3.0
        if replayed(low) >= target:
            high = low
        elif replayed(high) <= target:
            low = high
        for _ in range(FIT_ROUNDS if low < high else 0):
            middle = (low + high) / 2
            if replayed(middle) < target:
                low = middle
            else:
                high = middle
        k = (low + high) / 2
        factors.append(k)
        fitted.append(MeasuredIteration({r: _scaled(profiled[r], k, lengths[r]) for r in profiled}, sample.transmit_us))
    model.notes.append(note)
    k = median(factors, 1.0)
    if k < LOW_COMPUTE_FACTOR:
        model.notes.append(f"warning: the fitted compute factor is x{k:.2f}: the collectives as profiled (slowed by "
                           "the profiler) nearly fill the unprofiled steps on their own, so the split between compute "
                           "and communication is uncertain: what-ifs that change either are not backed for this run")
    return fitted, factors


LOW_COMPUTE_FACTOR = 0.25


def _op_scaling(model: JobModel) -> dict[str, float]:
    """Per phase, the median over ranks of (unprofiled duration / profiled duration): the factor the replay
    applies to the profiler's ops of that phase (below 1: the profiler inflated them)."""
    unprofiled = {"accumulate": "accumulate_us", "forward": "forward_us", "loss": "loss_us",
                  "backward": "backward_us", "finalize": "finalize_us", "update": "update_us", "tail": "tail_us"}
    ratios: dict[str, list[float]] = {}
    for r, profile in model.op_profiles.items():
        template = model.templates.get(r)
        for phase, attr in unprofiled.items():
            measured = profile.phases.get(phase)
            if template is not None and measured is not None and measured.profiled_us > 0:
                ratios.setdefault(phase, []).append(getattr(template, attr) / measured.profiled_us)
    return {phase: round(median(values, 1.0), 4) for phase, values in ratios.items()}


FIRST_SETTLED_ITERATION = 2  # the iterations before it set up (allocations, tracing, DDP's first rebuild)


def _warmup_iterations(trace) -> list[int]:
    """The warm-up iterations before the window, from the third on, less those the statistics set aside (a validation
    pass in one: 276 ms among 58-89 ms ones made the warm-up's median a job still settling)."""
    if not trace.profiled_iterations:
        return []
    first = min(trace.profiled_iterations)
    set_aside = set(trace.meta.get("disturbed_iterations", []))
    return [i for i, _, _ in trace.iterations if FIRST_SETTLED_ITERATION <= i < first and i not in set_aside]


def _median_over_ranks(run: RunTrace, chosen: dict[int, list[int]]) -> list[float]:
    """Per iteration index chosen on every rank: the median over ranks of its duration (µs), in order."""
    durations: dict[int, list[float]] = {}
    for r, indices in chosen.items():
        wanted = set(indices)
        for i, start, end in run.ranks[r].iterations:
            if i in wanted:
                durations.setdefault(i, []).append(end - start)
    everywhere = [i for i in sorted(durations) if len(durations[i]) == len(chosen)]
    return [float(np.median(durations[i])) for i in everywhere]
