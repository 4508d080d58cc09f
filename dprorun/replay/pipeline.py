"""Replay of a staged, partitioned synchronisation (BytePS): every partition of every tensor passes through a
chain of stages, and each stage is one device that serves partitions one at a time in the order they reach it.

From the recorded spans (entry into a stage's queue -> completion) each op's service time is what the stage
itself spent on it: end - max(entry, the stage's previous completion); the rest of its span is waiting. The
replay graph of a step: per partition, its entry delay (when BytePS took it up, from the tensor's start),
then its stages in order, with the measured hand-off between two stages (a loop thread picking it up; on a
non-root GPU also the wait for the root's PUSH/PULL, which that file does not show) as a delay that takes no
device. The root GPU's PUSH and PULL of a partition are the parameter-server topology of the one graph
(replay/ps_topology.py, recorded at the worker: the server's part is the measured wait between them). Replaying with the step's own times reproduces it; replaying with the other steps' medians predicts
it (`predict_steps`), and scaling a stage's service times answers what-ifs (e.g. PUSH and PULL x 0.5 for a
network twice as fast). Several GPUs of one machine replay together (`predict_machine_steps`): a non-root
GPU's stage that follows the gap waits for the root's PULL of the same partition instead.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from dprorun.replay.engine import GraphBuilder, ReplayGraph, ReplayResult, critical_path_report, replay
from dprorun.replay.passes import scale_devices
from dprorun.replay.ps_topology import PSLinks, PSPart, PSPlan, join_workers
from dprorun.trace.byteps import BytePSTrace
from dprorun.trace.model import OpKind
from dprorun.fsutil import UnanswerableError


@dataclass
class ChainTimes:
    """One step's measured times, per (tensor, partition): entry delay, and per stage (in order) the service
    time and the hand-off delay before it."""

    entry_us: dict[tuple[str, int], float]
    stages: dict[tuple[str, int], list[tuple[str, float, float, str]]]  # (stage, service, handoff, op kind)
    waiting_us: dict[str, float]  # per stage: time partitions spent queued in it
    span_us: float  # the step's measured synchronisation span
    spans: dict[tuple[str, int], list[tuple[float, float]]] = field(default_factory=dict)  # absolute, per stage
    # machine replay: (tensor, partition) -> (stage on this GPU that waits for the root GPU's PULL of the same
    # partition, the measured delay from that PULL's end to the stage's start)
    after_root: dict[tuple[str, int], tuple[str, float]] = field(default_factory=dict)


@dataclass
class PipelinePrediction:
    step: int
    predicted_us: float
    measured_us: float
    stage_busy_us: dict[str, float]
    critical_path: dict
    notes: list[str] = field(default_factory=list)

    @property
    def error(self) -> float:
        return self.predicted_us / self.measured_us - 1.0 if self.measured_us else 0.0


def step_times(bt: BytePSTrace, step: int, origin_us: Optional[float] = None) -> ChainTimes:
    """Service, waiting and hand-off times of one step, from its recorded spans; entry delays count from the
    tensor's own start in the step, or from `origin_us` (several GPUs of one machine on their common clock)."""
    ops = [op for op in bt.trace.ops if op.iteration == step]
    if not ops:
        raise UnanswerableError(f"{bt.path}: step {step} has no stage events")
    service: dict[int, float] = {}
    waiting: dict[str, float] = {}
    by_stage: dict[str, list[int]] = {}
    for k, op in enumerate(ops):
        by_stage.setdefault(op.phase, []).append(k)
    for stage, members in by_stage.items():
        free = -np.inf
        for k in sorted(members, key=lambda k: (ops[k].start_us, ops[k].end_us)):
            begin = max(ops[k].start_us, free)
            service[k] = max(0.0, ops[k].end_us - begin)
            waiting[stage] = waiting.get(stage, 0.0) + max(0.0, min(begin, ops[k].end_us) - ops[k].start_us)
            free = max(free, ops[k].end_us)
    chains: dict[tuple[str, int], list[int]] = {}
    for k, op in enumerate(ops):
        chains.setdefault((op.tensor, op.chunk), []).append(k)
    starts = {t: a for (t, s), (a, _) in bt.sync_spans.items() if s == step}
    entry, stages, spans = {}, {}, {}
    for key, members in chains.items():
        members.sort(key=lambda k: (ops[k].start_us, ops[k].end_us))
        origin = origin_us if origin_us is not None else starts.get(key[0], ops[members[0]].start_us)
        entry[key] = max(0.0, ops[members[0]].start_us - origin)
        rows, previous_end = [], None
        for k in members:
            handoff = 0.0 if previous_end is None else max(0.0, ops[k].start_us - previous_end)
            rows.append((ops[k].phase.upper(), service[k], handoff, ops[k].kind.value))
            previous_end = ops[k].end_us
        stages[key] = rows
        spans[key] = [(ops[k].start_us, ops[k].end_us) for k in members]
    span = next((end - start for i, start, end in bt.trace.iterations if i == step), 0.0)
    return ChainTimes(entry, stages, waiting, span, spans)


def median_times(samples: list[ChainTimes]) -> ChainTimes:
    """Per partition and stage, the median over steps with the same chain of stages."""
    keys = set.intersection(*(set(s.stages) for s in samples))
    entry, stages = {}, {}
    for key in keys:
        chains = [s.stages[key] for s in samples]
        layout = [tuple(r[0] for r in c) for c in chains]
        common = max(set(layout), key=layout.count)
        same = [c for c, stages_of in zip(chains, layout) if stages_of == common]
        entry[key] = float(np.median([s.entry_us[key] for s in samples]))
        stages[key] = [(stage, float(np.median([c[i][1] for c in same])), float(np.median([c[i][2] for c in same])),
                        same[0][i][3]) for i, stage in enumerate(common)]
    waiting = {k: float(np.median([s.waiting_us.get(k, 0.0) for s in samples]))
               for k in set().union(*(s.waiting_us for s in samples))}
    after_root = {}
    for key in keys:
        marks = [s.after_root[key] for s in samples if key in s.after_root]
        if marks:
            after_root[key] = (marks[0][0], float(np.median([m[1] for m in marks])))
    return ChainTimes(entry, stages, waiting, float(np.median([s.span_us for s in samples])),
                      after_root=after_root)


def machine_graph(gpus: list[ChainTimes], stage_scale: Optional[dict[str, float]] = None) -> ReplayGraph:
    """The replay graph of one step of one GPU, or of one machine's GPUs (the first is the root, which pushes
    and pulls): per partition, entry delay -> (hand-off -> stage) x stages, on the GPU's own stage devices
    (`byteps.<stage>`, `gpu<k>.byteps.<stage>`); a stage listed in `after_root` also waits for the root's PULL of
    the same partition (plus the measured delay after it) instead of its measured hand-off. `stage_scale` is the
    stage what-if, a pass on the built graph (`scale_stages`)."""
    graph = _stage_graph(gpus)
    return scale_stages(graph, stage_scale) if stage_scale else graph


def scale_stages(graph: ReplayGraph, stage_scale: dict[str, float]) -> ReplayGraph:
    """The stage what-if as a pass (replay/passes.scale_devices): every GPU's service of that stage x factor."""
    return scale_devices(graph, {f"*byteps.{stage.lower()}": factor for stage, factor in stage_scale.items()})


def _stage_graph(gpus: list[ChainTimes]) -> ReplayGraph:
    """Each GPU's local DFG (per partition: entry delay, then its stages with their hand-offs, on the GPU's stage
    devices) and, where the root GPU pushes and pulls a partition, the parameter-server topology between its In
    and Out nodes (replay/ps_topology.py, recorded at the worker: PUSH on the push device, the server's part as
    the measured wait between the PUSH's end and the PULL's start, PULL on the pull device)."""
    builder = GraphBuilder()
    multi = len(gpus) > 1

    def device(rank: int, stage: str) -> str:
        return f"gpu{rank}.byteps.{stage.lower()}" if multi else f"byteps.{stage.lower()}"

    pulled: dict[tuple[str, int], int] = {}  # the root's node after each partition's PULL
    order, parts, ins, outs = [], {}, {}, {}
    for rank, times in enumerate(gpus):
        # partitions reach BytePS in entry order; build them in that order so ties replay as recorded
        for key in sorted(times.stages, key=lambda k: (times.entry_us[k], k[1])):
            tensor, partition = key
            label = f"{tensor}.p{partition}" + (f".gpu{rank}" if multi else "")
            previous = builder.op(f"enter.{label}", "VIRTUAL", rank, None, times.entry_us[key])
            waits_for = times.after_root.get(key)
            rows = times.stages[key]
            push = _push_then_pull(rows) if rank == 0 else None
            i = 0
            while i < len(rows):
                stage, service, handoff, kind = rows[i]
                if i == push:  # In node (the PUSH's hand-off), the PS topology, Out node
                    pull = rows[i + 1]
                    ins[label] = builder.op(f"In.{label}", "VIRTUAL", rank, None, handoff)
                    builder.edge(previous, ins[label])
                    outs[label] = previous = pulled[key] = builder.op(f"Out.{label}", "VIRTUAL", rank, None, 0.0)
                    order.append(label)
                    parts[label] = [PSPart(0, 0, push_us=service, server_us=pull[2], pull_us=pull[1])]
                    i += 2
                    continue
                remote = waits_for is not None and waits_for[0] == stage and key in pulled
                if remote:
                    wait = builder.op(f"after_root.{stage}.{label}", "VIRTUAL", rank, None, waits_for[1])
                    builder.edge(pulled[key], wait)
                    node_inputs = [previous, wait]
                elif handoff > 0:
                    wait = builder.op(f"handoff.{stage}.{label}", "VIRTUAL", rank, None, handoff)
                    builder.edge(previous, wait)
                    node_inputs = [wait]
                else:
                    node_inputs = [previous]
                node = builder.op(f"{stage}.{label}", "QUEUE" if kind == OpKind.QUEUE.value else "COMM", rank,
                                  device(rank, stage), service)
                for u in node_inputs:
                    builder.edge(u, node)
                previous = node
                if rank == 0 and stage == "PULL":
                    pulled[key] = node
                i += 1
    plan = PSPlan(workers=1, servers=1, bigarray_bound=0, order=order, parts=parts, ins=[ins], outs=[outs],
                  links=PSLinks("worker-side"), local_nodes=builder.size,
                  worker_links=[(device(0, "PUSH"), device(0, "PULL"))])
    join_workers(builder, plan)
    return builder.build({"source": "byteps pipeline", "gpus": len(gpus), "ps_plan": plan, "ranks_built": 1})


def _push_then_pull(rows: list[tuple[str, float, float, str]]) -> Optional[int]:
    """Where a root GPU's chain hands a partition to the servers: the PUSH stage followed by its PULL."""
    stages = [row[0] for row in rows]
    if "PUSH" in stages:
        k = stages.index("PUSH")
        if k + 1 < len(stages) and stages[k + 1] == "PULL":
            return k
    return None


def _prediction(step: int, times: ChainTimes, measured_us: float, stage_scale: Optional[dict[str, float]],
                notes: list[str]) -> PipelinePrediction:
    graph = machine_graph([times], stage_scale)
    result: ReplayResult = replay(graph)
    return PipelinePrediction(step, result.iteration_time_us, measured_us, dict(result.device_busy_us),
                              critical_path_report(graph, result, top=10), list(notes))


def steps_with_events(bt: BytePSTrace) -> dict[int, ChainTimes]:
    """Every step that has stage events, with its times; at least 2 (a ValueError says why not)."""
    present = {op.iteration for op in bt.trace.ops if op.iteration >= 0}
    per_step = {s: step_times(bt, s) for s in sorted(present)}
    if len(per_step) < 2:
        why = "" if bt.sync_spans else " (no per-step \"total\" span: the steps cannot be told apart)"
        raise UnanswerableError(f"{bt.path}: {len(per_step)} step(s) with stage events{why}; predicting a step needs at "
                         "least 2")
    return per_step


def predict_steps(bt: BytePSTrace, stage_scale: Optional[dict[str, float]] = None) -> list[PipelinePrediction]:
    """Each step predicted from the medians of the other steps (leave one out), replayed as a pipeline."""
    per_step = steps_with_events(bt)
    notes = []
    if bt.role == "worker" and stage_scale and any(k.upper() in ("PUSH", "PULL") for k in stage_scale):
        notes.append("this GPU's file has no PUSH/PULL (the root GPU of its host does them): scaling them "
                     "changes nothing here; replay the root's comm.json")
    if bt.role == "root" and stage_scale and any(k.upper() == "PULL" for k in stage_scale):
        notes.append("a PULL's recorded service includes the server waiting for every worker's PUSH: scaling "
                     "PULL scales that wait too")
    out = []
    for step, own in per_step.items():
        others = median_times([t for s, t in per_step.items() if s != step])
        out.append(_prediction(step, others, own.span_us, stage_scale, notes))
    return out


def reconstruct_step(bt: BytePSTrace, step: int) -> PipelinePrediction:
    """Replay a step with its own measured times (the model reproducing what it was built from)."""
    own = step_times(bt, step)
    return _prediction(step, own, own.span_us, None, [])


def machine_step_times(root: BytePSTrace, others: list[BytePSTrace], step: int) -> list[ChainTimes]:
    """One step of one machine's GPUs on their common clock (the root's file first): entry delays from the
    step's earliest start, and on every other GPU the first stage that starts after the root's PULL of the same
    partition has ended, with the delay between the two (`ChainTimes.after_root`). The first ChainTimes's
    `span_us` is the machine's step: first start to last end over the GPUs."""
    spans = []
    for bt in (root, *others):
        span = next(((a, b) for i, a, b in bt.trace.iterations if i == step), None)
        if span is None:
            raise UnanswerableError(f"{bt.path}: no step {step}")
        spans.append(span)
    origin = min(a for a, _ in spans)
    gpus = [step_times(bt, step, origin) for bt in (root, *others)]
    for times in gpus[1:]:
        for key, rows in times.stages.items():
            root_rows = gpus[0].stages.get(key, [])
            pull_end = next((b for (stage, *_), (_, b) in zip(root_rows, gpus[0].spans.get(key, [])) if stage == "PULL"),
                            None)
            if pull_end is None:
                continue
            for (stage, *_), (a, _) in zip(rows, times.spans[key]):
                if a >= pull_end:
                    times.after_root[key] = (stage, a - pull_end)
                    break
    gpus[0].span_us = max(b for _, b in spans) - origin
    return gpus


def predict_machine_steps(root: BytePSTrace, others: list[BytePSTrace],
                          stage_scale: Optional[dict[str, float]] = None) -> list[PipelinePrediction]:
    """Each step of the machine (its GPUs' files together) predicted from the other steps' medians."""
    if root.role != "root":
        raise UnanswerableError(f"{root.path}: not the root GPU's file (it has no PUSH/PULL)")
    steps = sorted(set.intersection(*({op.iteration for op in bt.trace.ops if op.iteration >= 0}
                                      for bt in (root, *others))))
    if len(steps) < 2:
        raise UnanswerableError(f"{len(steps)} step(s) common to the files; predicting a step needs at least 2")
    per_step = {s: machine_step_times(root, others, s) for s in steps}
    out = []
    for step, own in per_step.items():
        rest = [per_step[s] for s in steps if s != step]
        typical = [median_times([gpus[g] for gpus in rest]) for g in range(len(own))]
        graph = machine_graph(typical, stage_scale)
        result = replay(graph)
        out.append(PipelinePrediction(step, result.iteration_time_us, own[0].span_us, dict(result.device_busy_us),
                                      critical_path_report(graph, result, top=10), []))
    return out


def pipeline_summary(bt: BytePSTrace, stage_scale: Optional[dict[str, float]] = None) -> dict:
    """Per stage: service and waiting per step (medians over steps), its share of the step; the steps'
    measured sync times and their leave-one-out replayed predictions (and with `stage_scale`, the what-if)."""
    per_step = list(steps_with_events(bt).values())
    typical = median_times(per_step)
    service: dict[str, list[float]] = {}
    for t in per_step:
        totals: dict[str, float] = {}
        for rows in t.stages.values():
            for stage, busy, _, _ in rows:
                totals[stage] = totals.get(stage, 0.0) + busy
        for stage, busy in totals.items():
            service.setdefault(stage, []).append(busy)
    span = typical.span_us or 1.0
    stages = []
    for stage in bt.stages:
        busy = float(np.median(service.get(stage, [0.0])))
        stages.append({"stage": stage, "service_ms": round(busy / 1000, 3),
                       "waiting_ms": round(typical.waiting_us.get(stage.lower(), 0.0) / 1000, 3),
                       "busy_pct_of_step": round(100 * busy / span, 1)})
    as_run = predict_steps(bt)
    errors = [abs(p.error) for p in as_run]
    share = as_run[0].critical_path["share_pct"]
    notes = []
    if bt.role == "worker":
        notes.append(f"{share.get('virtual', 0.0):.0f} % of the replayed critical path is entry and hand-off delay: "
                     "on a non-root GPU mostly the wait for the root GPU's PUSH/PULL, which only the root's "
                     "comm.json shows")
    if bt.truncated:
        notes.append("the file was cut short: the last step may be incomplete")
    doc = {"path": bt.path, "role": bt.role, "tensors": len(bt.tensors), "partitions": bt.partitions,
           "steps": bt.steps, "truncated": bt.truncated, "stages": stages,
           "bottleneck": max(stages, key=lambda s: s["service_ms"])["stage"] if stages else None,
           "measured_sync_ms": [round(p.measured_us / 1000, 3) for p in as_run],
           "predicted_sync_ms": [round(p.predicted_us / 1000, 3) for p in as_run],
           "leave_one_out_error_pct": {"median": round(100 * float(np.median(errors)), 2),
                                       "max": round(100 * float(max(errors)), 2)},
           "critical_path_share_pct": share, "notes": notes}
    if stage_scale:
        whatif = predict_steps(bt, stage_scale)
        doc["whatif"] = {"stage_scale": dict(stage_scale),
                         "predicted_sync_ms": round(float(np.median([p.predicted_us for p in whatif])) / 1000, 3),
                         "as_run_sync_ms": round(float(np.median([p.predicted_us for p in as_run])) / 1000, 3),
                         "notes": whatif[0].notes}
    return doc


def machine_summary(traces: list[BytePSTrace], stage_scale: Optional[dict[str, float]] = None) -> dict:
    """The GPUs of one machine replayed together (exactly one root file): each step predicted from the other
    steps, and the what-if, for the machine's whole step (the non-root GPUs wait for the root's PULLs)."""
    roots = [bt for bt in traces if bt.role == "root"]
    if len(roots) != 1:
        raise UnanswerableError(f"a machine replay needs exactly one root GPU's file (with PUSH/PULL), got {len(roots)}")
    others = [bt for bt in traces if bt is not roots[0]]
    as_run = predict_machine_steps(roots[0], others)
    linked = [len(gpus.after_root) for gpus in machine_step_times(roots[0], others, as_run[0].step)[1:]]
    errors = [abs(p.error) for p in as_run]
    doc = {"gpus": len(traces), "root": roots[0].path, "linked_partitions": linked,
           "measured_sync_ms": [round(p.measured_us / 1000, 3) for p in as_run],
           "predicted_sync_ms": [round(p.predicted_us / 1000, 3) for p in as_run],
           "leave_one_out_error_pct": {"median": round(100 * float(np.median(errors)), 2),
                                       "max": round(100 * float(max(errors)), 2)}}
    if stage_scale:
        whatif = predict_machine_steps(roots[0], others, stage_scale)
        doc["whatif"] = {"stage_scale": dict(stage_scale),
                         "predicted_sync_ms": round(float(np.median([p.predicted_us for p in whatif])) / 1000, 3),
                         "as_run_sync_ms": round(float(np.median([p.predicted_us for p in as_run])) / 1000, 3)}
    return doc
