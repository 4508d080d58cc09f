"""TensorFlow's profile (trace/xplane.py) read into a rank's records: the steps a call of a step function runs, each
profiled step's forward / backward / update spans and its gradient packs' all-reduces (from the profile's collectives,
or from Horovod's timeline for horovod.tensorflow), the collectives outside the packs, and the compute ops. The
rank's events document (trace/rundir.py) gets these records as the hooks write them for PyTorch.
"""
from __future__ import annotations

import re
from collections import Counter
from typing import Optional

from dprorun.layout import CommRecord
from dprorun.trace.horovod import HorovodTimeline
from dprorun.trace.model import Op, OpKind, RankTrace, is_tf_tracker
from dprorun.trace.xplane import TFProfile


def _tf_step_parts(profile: TFProfile, starts: list[float],
                   steps: list[int]) -> dict[int, tuple[float, float, list[Op], list[Op]]]:
    """Per profiled step (the hooks' iteration boundaries, on the same clock as the profile): (start, end, its
    compute ops, its collectives)."""
    parts = {}
    for step in steps:
        if step + 1 >= len(starts):
            continue
        start, end = float(starts[step]), float(starts[step + 1])
        ops = [op for op in profile.compute if start <= op.start_us < end]
        colls = sorted((op for op in profile.collectives if start <= op.start_us < end), key=lambda op: op.start_us)
        parts[step] = (start, end, ops, colls)
    return parts


def _steps_per_call(profile: TFProfile, starts: list[float], profiled: list[int], spans: list) -> int:
    """Training steps per call of a TensorFlow step function: how often the call's first collective op runs in
    it (once per step; a function that loops over steps runs it once per pass), as most profiled calls have it
    (a call the profiler cut short counts fewer); 1 unless at least half of them agree. Where the profile holds
    no collective (horovod.tensorflow: TensorFlow's profiler records none of Horovod's ops), the input fetches
    inside each call count the steps instead (`next(iterator)` once per step). Each call on its own (the hooks'
    "step" spans), where an iteration holds several: a GAN's discriminator and generator functions, each
    all-reducing under the same scope name, are two calls of one step each, not a call of two steps; a collective of
    another execution (its step_id: a loss reduced with strategy.reduce after the step) is not another step."""
    calls = _calls(_tf_step_parts(profile, starts, profiled), spans)
    counts, fetches = [], []
    for start, end, colls in calls:
        if colls:  # the first op's scope in the same execution (step_id): another function's collective, e.g. a
            # strategy.reduce of the loss run after the step, may share the scope name ("CollectiveReduceV2")
            first = (colls[0].args.get("scope"), colls[0].args.get("step_id"))
            counts.append(sum(1 for op in colls if (op.args.get("scope"), op.args.get("step_id")) == first))
        fetches.append(sum(1 for f in profile.fetches if start <= f < end))
    if not counts:  # a call the profiler cut short may show none
        counts = [f for f in fetches if f > 0]
    if not counts:
        return 1
    k, agreeing = Counter(counts).most_common(1)[0]
    return k if 2 * agreeing >= len(counts) else 1


def _calls(parts: dict, spans: list) -> list[tuple[float, float, list[Op]]]:
    """(start, end, collectives) of each step-function call in the profiled iterations `parts`: the iteration itself
    where the hooks marked no more than one call in it."""
    calls = []
    for step, (start, end, _, colls) in parts.items():
        marked = [(float(a), float(b)) for i, name, a, b in spans if i == step and name == "step"]
        if len(marked) <= 1:
            calls.append((start, end, colls))
            continue
        edges = [a for a, _ in marked[1:]] + [end]
        calls += [(a, b, [op for op in colls if a <= op.start_us < b]) for (a, _), b in zip(marked, edges)]
    return calls


def _step_starts(profile: TFProfile, start: float, end: float, k: int) -> list[float]:
    """The starts of the k steps of the call [start, end): at the steps' input fetches where there are k, else at
    the occurrences of the call's first op that runs k times (each step runs its ops in about the same order; a
    loop over tensors the function was given fetches nothing), else (a call the profiler did not see) k equal
    parts."""
    fetches = [f for f in profile.fetches if start <= f < end]
    if len(fetches) == k:
        return [start] + fetches[1:]
    ops = sorted((op for op in profile.compute if start <= op.start_us < end), key=lambda op: op.start_us)
    runs: dict[str, list[float]] = {}
    for op in ops:
        runs.setdefault(op.args.get("op", op.name), []).append(op.start_us)
    marker = next((runs[name] for name in (op.args.get("op", op.name) for op in ops) if len(runs[name]) == k), None)
    if marker is not None:
        return [start] + marker[1:]
    return [start + j * (end - start) / k for j in range(k)]


def split_multi_step_calls(doc: dict, profile: TFProfile) -> None:
    """A step function that runs k training steps per call (Keras's steps_per_execution, a custom loop's
    tf.range inside the tf.function): the hooks' iterations are calls; here they become steps, so that phases,
    packs and the replay are a step's (`_step_starts`: a profiled call at its steps' input fetches or first
    repeated op, one the profiler did not see in k equal parts). Every iteration-indexed record is renumbered."""
    window = doc["window"]
    profiled = [int(i) for i in window.get("kineto_iterations", [])]
    starts = [float(x) for x in doc["iteration_starts_us"]]
    k = _steps_per_call(profile, starts, profiled, doc["spans"])
    if k <= 1:
        return
    bounds = [_step_starts(profile, s, e, k) for s, e in zip(starts, starts[1:])]
    cpu = [float(x) for x in doc.get("iteration_cpu_s", [])]
    if len(cpu) == len(starts):
        doc["iteration_cpu_s"] = [c0 + (c1 - c0) * (b - s) / max(e - s, 1e-9)
                                  for (s, e, c0, c1), parts in zip(zip(starts, starts[1:], cpu, cpu[1:]), bounds)
                                  for b in parts] + cpu[-1:]
    doc["iteration_starts_us"] = [b for parts in bounds for b in parts] + starts[-1:]

    def sub(i: int, t: float) -> int:  # the step of call i that holds time t
        parts = bounds[i] if 0 <= i < len(bounds) else [t]
        return i * k + max(0, sum(1 for b in parts if b <= t) - 1)

    spans = []
    for i, name, start, end in doc["spans"]:
        if name == "step" and 0 <= i < len(bounds):
            edges = bounds[i] + [end]
            spans += [[i * k + j, name, max(start, edges[j]), edges[j + 1]] for j in range(k)]
        else:
            spans.append([sub(i, start), name, start, end])
    doc["spans"] = spans
    doc["host_cpu_stat"] = [[row[0] * k, *row[1:]] for row in doc.get("host_cpu_stat", [])]
    for key in ("warmup", "active", "clean"):
        window[key] = int(window.get(key, 0)) * k
    if window.get("cut_at") is not None:  # a switch to another model's step function, at a call
        window["cut_at"] = int(window["cut_at"]) * k
    window["kineto_iterations"] = [i * k + j for i in profiled for j in range(k)]
    window["steps_per_call"] = k
    doc["disturbed_iterations"] = [i * k + j for i in doc.get("disturbed_iterations", []) for j in range(k)]
    doc.setdefault("warnings", []).append(
        f"each call of the step function ran {k} training steps (Keras's steps_per_execution, or a loop inside the "
        f"tf.function): iterations here are steps, the profiled calls split where each step starts, the "
        f"others into {k} equal parts")


def backward_start(ops: list[Op], bw_end: float) -> float:
    """Where a TensorFlow step's backward starts: the split of its ops before `bw_end` that leaves the least
    gradient-op time before it and forward-op time after it. TensorFlow runs an op as soon as its inputs exist, so
    a gradient op that needs only shapes (an embedding lookup's gradient concat) runs during the forward: the
    earliest gradient op put a GRU net's forward at 2.4 ms of its real 7.7."""
    timed = sorted((op for op in ops if op.start_us < bw_end and op.kind in (OpKind.FW, OpKind.BW)),
                   key=lambda op: op.start_us)
    forward_after = sum(op.dur_us for op in timed if op.kind is OpKind.FW)
    backward_before, best, best_cost = 0.0, None, float("inf")
    for op in timed:
        if op.kind is OpKind.BW and backward_before + forward_after < best_cost:
            best, best_cost = op.start_us, backward_before + forward_after
        if op.kind is OpKind.BW:
            backward_before += op.dur_us
        else:
            forward_after -= op.dur_us
    return best if best is not None else min(op.start_us for op in ops if op.kind is OpKind.BW)


def add_tf_records(doc: dict, profile: TFProfile, horovod_timeline: Optional[HorovodTimeline] = None) -> None:
    """A TensorFlow worker's hooks see only whole steps; its profiled steps' phases, per-pack all-reduces and
    gradient-ready times come from the profile, written into the events document as the DDP hooks' records
    are (forward: step start -> first gradient op; backward: gradient ops; update: after the last collective;
    one bucket per all-reduce pack, from the packs the hooks recorded while the step function was traced;
    a gradient is ready when the op producing it ends). horovod.tensorflow: TensorFlow's profiler does not
    record Horovod's asynchronous ops; each tensor's all-reduce runs from its gradient being ready on this
    worker to the end of its operation in Horovod's timeline (the coordinator's, same host clock)."""
    tracker = next((t for t in doc.get("trackers", []) if is_tf_tracker(t)), None)
    if tracker is None:
        return
    packs = tracker.get("packs") or []
    names = [n for pack in packs for n in pack.get("tensors", [])]
    sizes = dict(zip(names, [b for pack in packs for b in pack.get("bytes", [])]))
    doc["buckets"] = [{"ddp": 0, "index": k, "nbytes": int(sum(pack.get("bytes", []))),
                       "params": list(pack.get("tensors", [])), "dtype": "", "numel": 0,
                       "call": int(pack.get("call", 0))} for k, pack in enumerate(packs)]
    per_pack = tracker.get("bytes_per_pack")
    doc["params"] = {"0": {"order": names, "bytes": sizes,
                           "bucket_cap_mb": (per_pack / (1 << 20)) if per_pack else None}}
    horovod = tracker.get("framework") == "horovod"
    operations = _horovod_operations(horovod_timeline, packs) if horovod else {}
    profiled = list(doc["window"].get("kineto_iterations", []))
    incomplete: list[int] = []
    outside: list[dict] = []  # per profiled step, the collectives that all-reduce no pack
    for step, (start, end, ops, colls) in _tf_step_parts(profile, doc["iteration_starts_us"], profiled).items():
        ops, colls, earlier = _last_syncing_call(step, start, end, ops, colls, doc["spans"])
        backward = [op for op in ops if op.kind is OpKind.BW]
        if not backward:
            continue
        bw_end = max(op.end_us for op in backward)
        bw_start = backward_start(ops, bw_end)
        produced = {op.args.get("op"): op.end_us for op in ops}
        ready_of = {}
        for name in names:
            op_name = name.split(":", 1)[0]
            ready = produced.get(op_name)
            if ready is None:  # an op the profiler does not show (a Reshape): the last op of its scope
                scope = op_name.rsplit("/", 1)[0] + "/"
                ready = max((t for n, t in produced.items() if n and n.startswith(scope)), default=bw_end)
            ready_of[name] = ready
            doc["grad_ready"].append([step, name, ready])
        if horovod:
            records = []
            for k, pack in enumerate(packs):
                operation = next(((s, e) for s, e in operations.get(k, []) if start <= s < end), None)
                if operation is not None:  # enqueued by the operation's start at the latest: a gradient's ready
                    # time read later than that (a producing op the profile names otherwise) is not this tensor's
                    enqueue = min(max(ready_of[n] for n in pack.get("tensors", [])), operation[0])
                    records.append(CommRecord(step, 0, k, enqueue, enqueue, operation[1]))
            if len(records) < len(packs):  # e.g. the timeline's writer had not flushed the step when it stopped
                incomplete.append(step)
                continue
        else:
            chosen = pack_collectives(packs, colls)
            records = [CommRecord(step, 0, k, c.start_us, c.start_us, c.end_us) for k, c in enumerate(chosen)]
            others = earlier + [c for c in colls if not any(c is x for x in chosen)]  # sparse gradients'
            # all-gathers, a synchronized BatchNorm's moments, Keras's metric reductions and a loss reduced after
            # the step (inside the update), the step's earlier step functions' all-reduces (before its forward)
            if others:
                outside.append({"step": step, "names": [c.args.get("scope") or c.name for c in others],
                                "us": round(sum(c.end_us - c.start_us for c in others), 1)})
        update_start = max([bw_end] + [r.done_us for r in records])
        doc["spans"] += [[step, "forward0", start, bw_start], [step, "backward0", bw_start, bw_end],
                         [step, "update", update_start, max([update_start] + [op.end_us for op in ops])]]
        doc["comm"] += [r.row() for r in records]
    if outside:
        doc["window"]["collectives_outside_packs"] = outside
    if incomplete:
        doc["window"]["kineto_iterations"] = [i for i in profiled if i not in incomplete]
        doc["disturbed_iterations"] = sorted(set(doc.get("disturbed_iterations", [])) | set(incomplete))
        doc.setdefault("warnings", []).append(
            f"profiled step(s) {incomplete} left out: Horovod's timeline lacks some of their all-reduces "
            + ("(no timeline in the run directory)" if horovod_timeline is None else "(cut short when it stopped?)"))


def loop_free(op_name: str) -> str:
    """An op's name without the loop scopes before it ("while/CollectiveReduceV2", as a loop's body is traced,
    is "CollectiveReduceV2" in the profile, `xplane.name_outside_loop`)."""
    return re.sub(r"^(?:while(?:_\d+)?/)+", "", op_name)


def pack_collectives(packs: list[dict], colls: list[Op]) -> list[Op]:
    """The step's collective of each pack, in the packs' order: by the collective op's name the hooks recorded
    while the step function was traced (a synchronized BatchNorm's moments or a second optimizer's gradients are
    all-reduced by other collectives of the same step), else the step's first collectives in turn."""
    named = [p.get("collective") for p in packs]
    if named and all(named):
        chosen: list[Op] = []
        for name in named:
            found = next((c for c in colls if loop_free(c.args.get("scope") or "") == loop_free(name)
                          and not any(c is x for x in chosen)), None)
            if found is None:
                break
            chosen.append(found)
        else:
            return chosen
    return colls[:len(packs)]


def _last_syncing_call(step: int, start: float, end: float, ops: list[Op], colls: list[Op],
                       spans: list) -> tuple[list[Op], list[Op], list[Op]]:
    """(ops, collectives, the earlier calls' collectives) of the step's last call that all-reduces, where the step
    calls several step functions that do (runtime/turns.StepTurns: a GAN's discriminator, then its
    generator): that call's backward, packs and update are the step's (the hooks recorded its function's packs);
    the calls before it run inside the step's forward phase (as micro-batches do), their all-reduces kept as
    measured (collectives outside the packs). The whole step otherwise."""
    calls = [c for c in _calls({step: (start, end, ops, colls)}, spans) if c[2]]
    if len(calls) < 2:
        return ops, colls, []
    last = calls[-1][0]
    return ([op for op in ops if op.start_us >= last], [c for c in colls if c.start_us >= last],
            [c for c in colls if c.start_us < last])


def _horovod_operations(timeline: Optional[HorovodTimeline], packs: list[dict]) -> dict[int, list]:
    """Pack index -> [(start, end)] of its all-reduce operations in Horovod's timeline, the tensor found by the
    Horovod op's name recorded at trace time (the timeline's name carries TensorFlow's name scopes, and the
    cond branch's, before it)."""
    if timeline is None:
        return {}
    by_op = {}
    for k, pack in enumerate(packs):
        if pack.get("op"):
            by_op[pack["op"]] = k
    result: dict[int, list] = {}
    for op in timeline.trace.ops:
        if op.phase != "operation" or op.iteration < 0:
            continue
        k = by_op.get(str(op.tensor).rsplit("/", 1)[-1])
        if k is not None:
            result.setdefault(k, []).append((op.start_us, op.end_us))
    return result


def add_tf_compute(trace: RankTrace, profile: TFProfile) -> None:
    """The profiled steps' compute ops (op type, scope = the TF op name's scope), kinds from their place in
    the step: before the first gradient op forward, gradient ops backward, after backward the update."""
    starts = [start for _, start, _ in trace.iterations] + ([trace.iterations[-1][2]] if trace.iterations else [])
    profiled = list(trace.meta.get("kineto_iterations", []))
    for step, (start, end, ops, colls) in _tf_step_parts(profile, starts, profiled).items():
        backward = [op for op in ops if op.kind is OpKind.BW]
        if not backward:
            continue
        bw_end = max(op.end_us for op in backward)
        for op in ops:
            if op.kind is not OpKind.BW and op.start_us >= bw_end:
                op.kind = OpKind.UPDATE
            op.iteration = step
            op.host = trace.host
            trace.ops.append(op)
        for op in colls:
            op.iteration, op.host = step, trace.host
            trace.ops.append(op)
