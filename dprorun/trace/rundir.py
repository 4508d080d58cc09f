"""Read a run directory (manifest.json + rank_<r>/ folders) into the trace model.

Per rank, the hooks' events.json gives iterations, forward/backward/update spans, per-bucket enqueue and
completion, gradient-ready times and bucket layouts; the profiler's kineto_trace.json adds op-level compute
and each collective's transmission span, which splits every bucket's communication into QUEUE (enqueued,
waiting) and COMM (transmitting); a TensorFlow rank's profile (xplane.pb) is read into the same records by
trace/tf_records.py. Every problem with a file is a TraceError naming it.
"""
from __future__ import annotations

import bisect
import dataclasses
import os
from typing import Optional

from dprorun.fsutil import TraceError, read_json
from dprorun.layout import CLEAN_FILE, CLEAN_SCHEMA, EVENTS_FILE, EVENTS_SCHEMA, KINETO_FILE, MANIFEST_FILE, \
    MANIFEST_SCHEMA, SAMPLES_FILE, SCOPE_PREFIX, XPLANE_FILE, CommRecord, P2PRecord, rank_dir
from dprorun.graph.topology import transaction_id
from dprorun.stats import ranges_text
from dprorun.trace.horovod import HorovodTimeline, read_horovod_timeline
from dprorun.trace.kineto import KinetoTrace, read_kineto
from dprorun.trace.model import Bucket, Op, OpKind, RankTrace, RunTrace, Sample, bucket_key
from dprorun.trace.tf_records import add_tf_compute, add_tf_records, split_multi_step_calls
from dprorun.trace.xplane import read_tf_profile

SUPPORTED_EVENTS_VERSIONS = (1,)
SPAN_KINDS = (("forward", OpKind.FW), ("backward", OpKind.BW), ("update", OpKind.UPDATE))
MATCH_SLACK_US = 50.0  # a span may start this much before our enqueue timestamp


def _require(cond: bool, path: str, problem: str) -> None:
    if not cond:
        raise TraceError(path, problem)


def load_events(path: str) -> dict:
    doc = read_json(path)
    _require(isinstance(doc, dict), path, "not a JSON object")
    _require(doc.get("schema") == EVENTS_SCHEMA, path, f"not a dprorun events file (schema {doc.get('schema')!r})")
    _require(doc.get("version") in SUPPORTED_EVENTS_VERSIONS, path,
             f"unsupported events version {doc.get('version')!r} (this dprorun reads {SUPPORTED_EVENTS_VERSIONS})")
    for key, kind in (("iteration_starts_us", list), ("spans", list), ("comm", list), ("grad_ready", list),
                      ("buckets", list), ("window", dict)):
        _require(isinstance(doc.get(key), kind), path, f"field {key!r} missing or not a {kind.__name__}")
    _require(isinstance(doc.get("rank"), int), path, "field 'rank' missing")
    try:
        for row in doc["comm"]:
            _require(isinstance(row, list) and len(row) == 6, path, "malformed comm record")
            CommRecord.from_row(row)
        for row in doc["spans"]:
            _require(isinstance(row, list) and len(row) == 4, path, "malformed span record")
            float(row[2]), float(row[3])
        [float(x) for x in doc["iteration_starts_us"]]
    except (TypeError, ValueError):
        raise TraceError(path, "non-numeric timestamp in a record") from None
    return doc


def inference_set_aside(events: dict) -> set[int]:
    """A rank's iterations left out of the statistics for forward passes that train nothing (the hooks count them per
    iteration: a validation pass through the DDP model, a Gluon block called outside `autograd.record()`, a Module's
    forward with is_train False). An iteration with more of them than most iterations have is no training iteration
    as the others are (a validation pass falls inside one and lengthens it: 76-96 ms against 18-28 ms in
    benchmarks/shapes/ddp_data.py --eval). On MXNet so is the next one: reading the pass's results drains the
    engine, so the next iteration starts with nothing queued and runs shorter than a steady one
    (examples/mxnet_gluon.py validating every 3 steps: 11-23 ms after a validation, 23-40 ms the one after, 28-33 ms
    without validation). Where such iterations are more than one in four, no iteration runs steady between them: the
    passes are part of the job's cadence and none is set aside; a count every iteration has (a teacher's forward, a
    metric over each batch) is part of the iteration."""
    extra, iterations = _extra_inference(events)
    if not extra or 4 * len(extra) > iterations:
        return set()
    drained_next = any(t.get("framework") == "mxnet" for t in events.get("trackers", []))
    return extra | ({i + 1 for i in extra if i + 1 < iterations} if drained_next else set())


def inference_cadence_warning(events: dict) -> str:
    """What the statistics keep that a reader might not expect: forward passes that train nothing in more than one
    iteration in four (inference_set_aside leaves them in); "" otherwise."""
    extra, iterations = _extra_inference(events)
    if not extra or 4 * len(extra) <= iterations:
        return ""
    return (f"forward passes that train nothing (a validation pass) in {len(extra)} of {iterations} iterations, more "
            "than one in four: part of the job's cadence, they stay in its iteration times")


def _extra_inference(events: dict) -> tuple[set[int], int]:
    """(the iterations with more forward passes that train nothing than most iterations have, the iterations)."""
    passes = {int(i): int(n) for i, n in events.get("inference_passes", [])}
    iterations = max(0, len(events.get("iteration_starts_us", [])) - 1)
    if not passes or not iterations:
        return set(), iterations
    counts: dict[int, int] = {}
    for i in range(iterations):
        counts[passes.get(i, 0)] = counts.get(passes.get(i, 0), 0) + 1
    usual = max(sorted(counts), key=lambda n: counts[n])  # ties: the fewer passes
    return {i for i, n in passes.items() if n > usual and 0 <= i < iterations}, iterations


EARLIER_ROUNDS = ("the gradients' earlier all-reduces in the step (micro-batches accumulated without no_sync, or "
                  "optimizer steps inside one training step)")


def collectives_outside_buckets(doc: dict, comm: list[CommRecord], iterations: list[int]) -> list[dict]:
    """What a torch job's iterations synchronise beside the one round of gradient buckets the replay models, kept
    as a TensorFlow worker's collectives outside its packs are: the collectives the script called itself (the
    events' `script_collectives`: [iteration, function, calls, µs]), and a bucket's earlier all-reduces in one
    iteration (micro-batches accumulated without no_sync: every backward synchronises; the replay takes them for
    compute inside the micro-batches). Per iteration given: the names and the µs they took (0 where none ran)."""
    rows = [row for row in doc.get("script_collectives") or [] if row[0] in iterations]
    names = sorted({str(row[1]) for row in rows})
    took = {i: 0.0 for i in iterations}
    for i, _, _, us in rows:
        took[i] += float(us)
    rounds: dict[tuple[int, int, int], list[float]] = {}
    for record in comm:
        if record.iteration in took and record.done_us is not None:
            rounds.setdefault((record.iteration, record.ddp, record.bucket), []).append(
                record.done_us - record.enqueue_us)
    earlier = {key: sum(spans[:-1]) for key, spans in rounds.items() if len(spans) > 1}
    if earlier:
        names.append(EARLIER_ROUNDS)
    for (i, _, _), us in earlier.items():
        took[i] += us
    return [{"names": names, "us": round(took[i], 1)} for i in iterations] if names else []


def split_forwards_that_step(spans: list, grad_ready: list, comm: list[CommRecord]) -> list:
    """The hooks' span rows with each DDP forward that ran the backward and stepped the optimizers itself (Lightning's
    manual optimization: training_step inside the DDP wrapper calls manual_backward and opt.step) cut into what ran in
    it: per optimizer step, a forward (to the first gradient ready), a backward (to the last gradient ready or
    bucket handed over) and the step's update span. Such an iteration had one forward span holding everything and no
    backward span: no replay. The steps before the last read as the template's accumulate phase, their all-reduces
    as measured (collectives_outside_buckets' earlier rounds), as gradients accumulated without no_sync are."""
    by_iteration: dict[int, list] = {}
    for row in spans:
        by_iteration.setdefault(int(row[0]), []).append(row)
    ready: dict[int, list[float]] = {}
    for i, _, t in grad_ready:
        ready.setdefault(int(i), []).append(float(t))
    for record in comm:
        ready.setdefault(record.iteration, []).append(record.enqueue_us)  # a bucket handed over: the backward ran
    out = []
    for i, rows in by_iteration.items():
        forwards = [r for r in rows if str(r[1]).startswith("forward")]
        updates = sorted((r for r in rows if str(r[1]).startswith("update")), key=lambda r: r[2])
        cut = _cut_forward(forwards[0], updates, sorted(ready.get(i, []))) if len(forwards) == 1 and updates and \
            not any(str(r[1]).startswith("backward") for r in rows) else None
        out += rows if cut is None else [r for r in rows if r is not forwards[0] and r not in updates] + cut
    return out


def _cut_forward(forward: list, updates: list, ready_us: list[float]) -> Optional[list]:
    """One forward span's rows cut at the updates inside it (split_forwards_that_step); None where an update is
    outside it or a step had no gradient ready before it (nothing to tell its backward by)."""
    i, name, start, end = forward[0], forward[1], float(forward[2]), float(forward[3])
    if not all(start <= u[2] and u[3] <= end for u in updates):
        return None
    rows, begin = [], start
    for update in updates:
        inside = [t for t in ready_us if begin <= t <= update[2]]
        if not inside:
            return None
        rows += [[i, name, begin, inside[0]], [i, name.replace("forward", "backward", 1), inside[0], inside[-1]],
                 list(update)]
        begin = float(update[3])
    return rows


def rank_from_events(doc: dict, kineto: Optional[KinetoTrace], samples: Optional[dict]) -> RankTrace:
    rank = doc["rank"]
    trace = RankTrace(rank=rank, host=str(doc.get("host", "")), local_rank=int(doc.get("local_rank", 0)))
    window = doc["window"]
    warmup, active, clean = int(window.get("warmup", 0)), int(window.get("active", 0)), int(window.get("clean", 0))
    starts = [float(x) for x in doc["iteration_starts_us"]]
    trace.iterations = [(i, starts[i], starts[i + 1]) for i in range(len(starts) - 1)]
    complete = {i for i, _, _ in trace.iterations}
    disturbed = {int(i) for i in doc.get("disturbed_iterations", [])} | inference_set_aside(doc)
    # a script that went on to train another model cut the window or the clean iterations short there
    cut = warmup + active + clean if window.get("cut_at") is None else int(window["cut_at"])
    trace.profiled_iterations = [i for i in range(warmup, min(warmup + active, cut))
                                 if i in complete and i not in disturbed]
    trace.meta = {"job_id": doc.get("job_id", ""), "world_size": doc.get("world_size"),
                  "clean_iterations": [i for i in range(warmup + active, min(warmup + active + clean, cut))
                                       if i in complete and i not in disturbed],
                  "kineto_iterations": [i for i in window.get("kineto_iterations", [])
                                        if i in trace.profiled_iterations],
                  "disturbed_iterations": sorted(disturbed),
                  "clean_status": doc.get("clean_status", "missing"),
                  "window": window, "phase": doc.get("phase"), "disabled": doc.get("disabled", False),
                  "trackers": doc.get("trackers", []), "versions": doc.get("versions", {}),
                  "comm_unfinished": doc.get("comm_unfinished", 0), "pid": doc.get("pid"),
                  "script_profiler_iterations": sorted({int(i) for i in doc.get("script_profiler_iterations", [])})}
    trace.clock = dict(doc.get("clock") or {})
    trace.memory = dict(doc.get("memory") or {})
    trace.warnings = list(doc.get("warnings") or [])
    trace.warnings += [w for w in (inference_cadence_warning(doc),) if w]
    profiled = set(trace.profiled_iterations)
    comm = [CommRecord.from_row(row) for row in doc["comm"]]
    for iteration, name, start, end in split_forwards_that_step(doc["spans"], doc["grad_ready"], comm):
        if iteration not in profiled:
            continue
        kind = next((k for prefix, k in SPAN_KINDS if name.startswith(prefix)), OpKind.OTHER)
        stream = "step" if name == "step" else "phase"  # a TensorFlow worker's whole step, not a compute phase
        trace.ops.append(Op(name=name, kind=kind, rank=rank, start_us=float(start), end_us=float(end),
                            iteration=iteration, stream=stream, host=trace.host, source="hooks"))
    if not window.get("collectives_outside_packs"):  # a TensorFlow worker's are read from its profile
        window["collectives_outside_packs"] = collectives_outside_buckets(doc, comm,
                                                                          trace.unprofiled_window_iterations())
    for entry in doc["buckets"]:
        trace.buckets.append(Bucket(index=int(entry["index"]), nbytes=int(entry["nbytes"]),
                                    ddp=int(entry.get("ddp", 0)),
                                    params=list(entry.get("params", [])), dtype=str(entry.get("dtype", "")),
                                    numel=int(entry.get("numel", 0)), sparse=bool(entry.get("sparse", False)),
                                    buffer_nbytes=int(entry.get("buffer_nbytes", 0)),
                                    hook_work=bool(entry.get("wire_measured")) and not entry.get("wire_dtype"),
                                    collective=str(entry.get("collective", "all_reduce")),
                                    gathers_gradients=bool(entry.get("gathers_gradients", False)),
                                    pack_call=int(entry.get("call", 0))))
    params = (doc.get("params") or {}).get("0") or {}
    trace.param_order = list(params.get("order", []))
    trace.param_bytes = {k: int(v) for k, v in (params.get("bytes") or {}).items()}
    trace.meta["bucket_cap_mb"] = params.get("bucket_cap_mb")
    trace.grad_ready = [(int(i), str(n), float(t)) for i, n, t in doc["grad_ready"] if i in profiled]
    trace.clock["probes"] = [p for p in doc.get("clock_probes", []) if isinstance(p, list) and len(p) == 5]
    trace.meta["comm_detail"] = doc.get("comm_detail", "bucket")
    _read_calibration(trace, doc)
    trace.meta["cpu"] = dict(doc.get("cpu") or {})
    first_send = _add_p2p(trace, doc, profiled)
    _add_comm(trace, doc, comm, kineto, profiled, first_send)
    _infer_updates(trace)
    if kineto is not None:
        _add_kineto_compute(trace, kineto, profiled, copy_ops=bool(kineto.gpu))
    if samples:
        for entry in samples.get("samples", []):
            try:
                trace.samples.append(Sample(float(entry["t"]), str(entry["src"]), dict(entry["v"])))
            except (KeyError, TypeError, ValueError):
                continue
        trace.meta["nvml_status"] = samples.get("nvml_status")
        trace.meta["host_sampler_status"] = samples.get("host_status")
    trace.ops.sort(key=lambda op: (op.start_us, op.end_us))
    return trace


def _read_calibration(trace: RankTrace, doc: dict) -> None:
    """The window's calibration calls (runtime/calibration.py) into trace.meta: [bytes, µs] idle, the transport's
    CPU for each, the same beside compute, and Horovod's calls per wire dtype [dtype, bytes, µs, float32 µs]."""
    rows = [row for row in doc.get("calibration", []) if isinstance(row, list) and len(row) >= 2
            and all(isinstance(x, (int, float)) for x in row)]
    trace.meta["calibration"] = [[int(row[0]), float(row[1])] for row in rows]
    trace.meta["calibration_transport_cpu"] = [[int(row[0]), float(row[2])] for row in rows if len(row) >= 3]
    trace.meta["calibration_under_compute"] = [
        [int(row[0]), float(row[1])] for row in doc.get("calibration_under_compute", [])
        if isinstance(row, list) and len(row) >= 2 and all(isinstance(x, (int, float)) for x in row[:2])]
    trace.meta["calibration_dtypes"] = [[str(row[0]), int(row[1]), float(row[2]), float(row[3])]
                                        for row in doc.get("calibration_dtypes", []) if isinstance(row, list)
                                        and len(row) == 4 and all(isinstance(x, (int, float)) for x in row[1:])]


INFERRED_UPDATE = "update (inferred)"


def _infer_updates(trace: RankTrace) -> None:
    """A torch rank whose window stepped no torch.optim optimizer (an optimizer class of the script's own, or SGD
    applied in place by hand) has forward and backward spans and no update: its iterations were not replayed ("no
    profiled iteration has forward, backward and update spans"). The script's update runs once the backward has
    returned, which DDP holds until its all-reduces are done: each such iteration's update is taken as the time from
    its backward's end or its last collective's, whichever is later, to the next iteration (the script's update,
    its zero_grad and its next input: no tail of its own), and the trace says so (meta["inferred_update"])."""
    phases = [op for op in trace.ops if op.stream == "phase"]
    if any(op.kind is OpKind.UPDATE for op in phases) or not any(op.kind is OpKind.BW for op in phases):
        return
    if any(t.get("framework", "ddp") not in ("ddp", "collectives") for t in trace.meta.get("trackers", [])):
        return
    ends = {i: end for i, _, end in trace.iterations}
    backward_end: dict[int, float] = {}
    for op in phases:
        if op.kind is OpKind.BW:
            backward_end[op.iteration] = max(backward_end.get(op.iteration, op.end_us), op.end_us)
    for op in trace.ops:  # a collective is done where the hooks saw it done (the profiler's span of gloo's work
        # may close after the next iteration began)
        if op.iteration in backward_end and op.kind in (OpKind.COMM, OpKind.QUEUE) and op.source == "hooks":
            done = float(op.args.get("callback_done_us", op.end_us))
            backward_end[op.iteration] = max(backward_end[op.iteration], done)
    inferred = 0
    for iteration, start in sorted(backward_end.items()):
        end = ends.get(iteration)
        if end is None:
            continue
        start = min(start, end)
        trace.ops.append(Op(name=INFERRED_UPDATE, kind=OpKind.UPDATE, rank=trace.rank, start_us=start, end_us=end,
                            iteration=iteration, stream="phase", host=trace.host, source="hooks",
                            args={"inferred": "no torch.optim optimizer stepped"}))
        inferred += 1
    if inferred:
        trace.meta["inferred_update"] = inferred


def _add_p2p(trace: RankTrace, doc: dict, profiled: set) -> dict[tuple[int, str], float]:
    """Measured ring steps (`--comm-detail ring`) as SEND/RECV ops with transaction ids."""
    first_send: dict[tuple[int, str], float] = {}
    for row in doc.get("p2p", []):
        try:
            record = P2PRecord.from_row(row)
        except (TypeError, ValueError):
            raise TraceError(os.path.join(doc.get("_path", ""), "events.json"), "malformed p2p record") from None
        if record.iteration not in profiled:
            continue
        key = bucket_key(record.ddp, record.bucket)
        txn = transaction_id(key, record.iteration, record.step, record.chunk, record.src, record.dst)
        sending = record.role == "send"
        trace.ops.append(Op(name=f"{record.role}.{key}.s{record.step}.c{record.chunk}", kind=OpKind.COMM,
                            rank=trace.rank, start_us=record.start_us, end_us=record.end_us,
                            iteration=record.iteration, stream="comm", host=trace.host, tensor=key,
                            nbytes=record.nbytes, peer=record.dst if sending else record.src, chunk=record.chunk,
                            step=record.step, txn_id=txn, phase=record.role, source="hooks", granularity="chunk",
                            args={} if sending else {"posted_us": record.start_us}))
        if sending:
            slot = (record.iteration, key)
            first_send[slot] = min(first_send.get(slot, record.start_us), record.start_us)
    return first_send


def _add_comm(trace: RankTrace, doc: dict, comm: list[CommRecord], kineto: Optional[KinetoTrace], profiled: set,
              first_send: dict[tuple[int, str], float]) -> None:
    sizes = {(int(b["ddp"]), int(b["index"])): int(b["nbytes"]) for b in doc["buckets"]}
    candidates: list[Op] = []
    if kineto is not None:
        candidates = [op for op in kineto.collectives if op.stream.startswith("comm:") and "reduce" in op.name]
        candidates += [op for op in kineto.gpu if op.kind is OpKind.COMM and "allreduce" in op.name.lower()]
        candidates.sort(key=lambda op: op.start_us)
    used = [False] * len(candidates)
    cand_starts = [op.start_us for op in candidates]
    records = sorted((r for r in comm if r.iteration in profiled),
                     key=lambda r: r.enqueue_us)
    for record in records:
        iteration, enqueue, done = record.iteration, record.enqueue_us, record.done_us
        key = bucket_key(record.ddp, record.bucket)
        nbytes = sizes.get((record.ddp, record.bucket), 0)
        common = dict(rank=trace.rank, iteration=iteration, tensor=key, nbytes=nbytes, host=trace.host,
                      source="hooks")
        enqueue_cost = {"enqueue_cost_us": max(0.0, record.enqueued_us - enqueue)}
        ring_start = first_send.get((iteration, key))
        if ring_start is not None:  # measured ring: queueing ends when the first chunk is sent
            trace.ops.append(Op(name=f"queue.{key}", kind=OpKind.QUEUE, start_us=enqueue, end_us=ring_start,
                                stream="comm", phase="queue", args=dict(enqueue_cost), **common))
            trace.ops.append(Op(name=f"allreduce.{key}", kind=OpKind.COMM, start_us=ring_start, end_us=done,
                                stream="comm", phase="transmit", granularity="chunk", **common))
            continue
        match = None
        first = bisect.bisect_left(cand_starts, enqueue - MATCH_SLACK_US)
        for j in range(first, len(candidates)):
            op = candidates[j]
            if op.start_us > done:
                break
            if not used[j]:  # FIFO: the first unused transmission that started after the enqueue
                used[j] = True
                match = op
                break
        if match is None:
            trace.ops.append(Op(name=f"allreduce.{key}", kind=OpKind.COMM, start_us=enqueue, end_us=done,
                                stream="comm", phase="queue+transmit", granularity="collective",
                                args={"note": "transmission start unknown (no profiler span): queueing not "
                                              "separated", **enqueue_cost}, **common))
            continue
        tx_start = max(match.start_us, enqueue)
        trace.ops.append(Op(name=f"queue.{key}", kind=OpKind.QUEUE, start_us=enqueue, end_us=tx_start,
                            stream="comm", phase="queue", args=dict(enqueue_cost), **common))
        trace.ops.append(Op(name=f"allreduce.{key}", kind=OpKind.COMM, start_us=tx_start,
                            end_us=match.end_us, stream="comm", phase="transmit",
                            granularity="collective", args={"span": match.name, "callback_done_us": done},
                            **common))


def _name_module_scopes(ops: list[Op], annotations: list[Op]) -> None:
    """Each main-thread op inside a `module:<name>` profiler annotation (runtime/scopes.py) gets the innermost
    one's name as `args["scope"]` (ops sorted by start; the annotations nest like the module calls)."""
    scopes = sorted((a for a in annotations if a.name.startswith(SCOPE_PREFIX)),
                    key=lambda a: (a.start_us, -a.end_us))
    if not scopes:
        return
    open_scopes: list[Op] = []
    k = 0
    for op in ops:
        if op.stream != "main":
            continue
        while k < len(scopes) and scopes[k].start_us <= op.start_us:
            while open_scopes and open_scopes[-1].end_us < scopes[k].start_us:
                open_scopes.pop()
            open_scopes.append(scopes[k])
            k += 1
        while open_scopes and open_scopes[-1].end_us < op.end_us:
            open_scopes.pop()
        if open_scopes:
            op.args["scope"] = open_scopes[-1].name[len(SCOPE_PREFIX):]


def _add_kineto_compute(trace: RankTrace, kineto: KinetoTrace, profiled: set, copy_ops: bool = False) -> None:
    """The profiled iterations' CPU ops and GPU activity into the rank's trace (their iteration, host and phase kind
    set; alignment shifts them later); `copy_ops`: copies, leaving the profiler trace as read (a GPU rank's, kept
    for the kernel-level DFG)."""
    _name_module_scopes(kineto.compute, kineto.annotations)
    iter_starts = [start for _, start, _ in trace.iterations]
    phases = sorted((op for op in trace.ops if op.stream == "phase"), key=lambda op: op.start_us)
    phase_starts = [op.start_us for op in phases]
    for op in kineto.compute + [g for g in kineto.gpu if g.kind is not OpKind.COMM]:
        index = bisect.bisect_right(iter_starts, op.start_us) - 1
        if index < 0 or trace.iterations[index][0] not in profiled or op.start_us >= trace.iterations[index][2]:
            continue
        if copy_ops:
            op = dataclasses.replace(op)
        op.iteration = trace.iterations[index][0]
        op.host = trace.host
        if op.stream == "main":
            p = bisect.bisect_right(phase_starts, op.start_us) - 1
            if p >= 0 and phases[p].end_us >= op.end_us and op.kind is not OpKind.COMM:
                op.kind = phases[p].kind
        trace.ops.append(op)


def _merge_clean_starts(doc: dict, path: str) -> None:
    """clean.json (written after the clean iterations, which follow the events' writing) extends the events'
    iteration start times from its first iteration on. Its absence is recorded: the clean reference is then
    whatever the events hold."""
    window = doc["window"]
    first = int(window.get("warmup", 0)) + int(window.get("active", 0))
    if not os.path.exists(path):
        doc["clean_status"] = "missing"
        return
    clean = read_json(path)
    _require(isinstance(clean, dict) and clean.get("schema") == CLEAN_SCHEMA, path, "not a dprorun clean file")
    _require(clean.get("rank") == doc["rank"], path, f"records rank {clean.get('rank')!r}, not {doc['rank']}")
    try:
        starts = [float(x) for x in clean.get("iteration_starts_us", [])]
        begin = int(clean.get("first_iteration", first))
    except (TypeError, ValueError):
        raise TraceError(path, "non-numeric timestamp in a record") from None
    own = [float(x) for x in doc["iteration_starts_us"]]
    doc["script_profiler_iterations"] = sorted(set(doc.get("script_profiler_iterations", []))
                                               | set(clean.get("script_profiler_iterations", [])))
    if starts and begin <= len(own):
        doc["iteration_starts_us"] = own[:begin] + starts
    doc["clean_status"] = "complete" if clean.get("complete") else "cut short (the job ended inside them)" if \
        window.get("cut_at") is None else "cut short (the script went on to train another model)"


def load_rank(folder: str, expected_rank: Optional[int] = None, detail: bool = True,
              horovod_timeline: Optional[HorovodTimeline] = None) -> RankTrace:
    """One rank's files in the trace model; `detail=False`: without the profiler's op-level compute and GPU
    activity (large runs keep those for a few ranks only, see load_run); `horovod_timeline`: the job's, for
    horovod.tensorflow workers' all-reduces."""
    events_path = os.path.join(folder, EVENTS_FILE)
    doc = load_events(events_path)
    if expected_rank is not None and doc["rank"] != expected_rank:
        raise TraceError(events_path, f"records rank {doc['rank']} but lies in the folder of rank {expected_rank}")
    kineto = None
    kineto_path = os.path.join(folder, KINETO_FILE)
    snapshot = None
    if os.path.exists(kineto_path):
        kineto = read_kineto(kineto_path, rank=doc["rank"], detail=detail)
        if detail and kineto.gpu:  # kept as read for the kernel-level DFG: the rank's trace gets copies of its ops
            snapshot = kineto
    samples = None
    samples_path = os.path.join(folder, SAMPLES_FILE)
    if os.path.exists(samples_path):
        samples = read_json(samples_path)
        if not isinstance(samples, dict):
            raise TraceError(samples_path, "not a JSON object")
    _merge_clean_starts(doc, os.path.join(folder, CLEAN_FILE))
    tf_profile = None
    xplane_path = os.path.join(folder, XPLANE_FILE)
    if os.path.exists(xplane_path):
        skew = float(doc.get("clock", {}).get("test_skew_us") or 0.0)
        tf_profile = read_tf_profile(xplane_path, doc["rank"], shift_us=skew)
        split_multi_step_calls(doc, tf_profile)
        add_tf_records(doc, tf_profile, horovod_timeline)
    trace = rank_from_events(doc, kineto, samples)
    trace.kineto = snapshot
    if tf_profile is not None and detail:
        add_tf_compute(trace, tf_profile)
    variants_path = os.path.join(folder, "variants.json")
    if os.path.exists(variants_path):
        variants = read_json(variants_path)
        if not isinstance(variants, dict) or not isinstance(variants.get("variants"), dict):
            raise TraceError(variants_path, "not a dprorun compute-variants document")
        trace.meta["compute_variants"] = variants["variants"]
        trace.meta["compute_variants_device"] = variants.get("device")
    if kineto is None and tf_profile is None and doc["window"].get("kineto"):
        tf = any(t.get("framework") == "tf" for t in doc.get("trackers", []) if isinstance(t, dict))
        trace.warnings.append(f"no profiler trace ({XPLANE_FILE if tf else KINETO_FILE}) for this rank: op-level "
                              "compute and transmission spans are missing")
    return trace


DETAIL_RANKS_ALL_UP_TO = 64  # larger runs keep op-level profiler detail for the first DETAIL_RANKS ranks only
DETAIL_RANKS = 8
PARALLEL_FROM_RANKS = 32


def detail_ranks_for(world: int) -> Optional[set[int]]:
    """Ranks whose op-level compute the analysis keeps: all of a run up to 64 ranks, else ranks 0-7 (every rank
    keeps its phases, buckets, collectives and samples)."""
    return None if world <= DETAIL_RANKS_ALL_UP_TO else set(range(DETAIL_RANKS))


def _load_one(task: tuple[str, int, bool, Optional[HorovodTimeline]]) -> RankTrace:
    folder, rank, detail, timeline = task
    return load_rank(folder, expected_rank=rank, detail=detail, horovod_timeline=timeline)


HOROVOD_TIMELINE_FILE = "horovod_timeline.json"  # written by the coordinator of a --backend horovod job


def _read_run_timeline(run: RunTrace) -> None:
    """A Horovod job's timeline (its detailed tier, or the whole job with --horovod-full-timeline), read once:
    the replay's cost model and horovod.tensorflow's per-tensor all-reduces take it from the run."""
    path = os.path.join(run.run_dir, HOROVOD_TIMELINE_FILE)
    if not os.path.exists(path):
        return
    try:
        run.horovod_timeline = read_horovod_timeline(path)
    except TraceError as exc:
        run.problems.append(f"Horovod timeline not used: {exc}")


def load_run(run_dir: str, strict: bool = False, detail_ranks: Optional[set[int]] = None,
             workers: Optional[int] = None) -> RunTrace:
    """Load every rank; a missing rank is listed in `missing_ranks` (or an error with strict=True).
    `detail_ranks`: the ranks whose op-level profiler detail is kept (None: as `detail_ranks_for` says for the
    run's size). Runs of 32 ranks and more are read by `workers` processes (default: the usable cores)."""
    manifest_path = os.path.join(run_dir, MANIFEST_FILE)
    if not os.path.isdir(run_dir):
        raise TraceError(run_dir, "not a directory")
    manifest = read_json(manifest_path)
    if not isinstance(manifest, dict) or manifest.get("schema") != MANIFEST_SCHEMA:
        raise TraceError(manifest_path, "not a dprorun run manifest")
    world = int(manifest.get("world_size", 0))
    run = RunTrace(run_dir=run_dir, manifest=manifest, ranks={})
    _read_run_timeline(run)
    detail = detail_ranks if detail_ranks is not None else detail_ranks_for(world)
    tasks = []
    for rank in range(world):
        folder = rank_dir(run_dir, rank)
        if not os.path.exists(os.path.join(folder, EVENTS_FILE)):
            run.missing_ranks.append(rank)
            continue
        tasks.append((folder, rank, detail is None or rank in detail, run.horovod_timeline))
    for trace in _map_ranks(tasks, workers):
        job = trace.meta.get("job_id")
        if job and manifest.get("job_id") and job != manifest["job_id"]:
            raise TraceError(os.path.join(rank_dir(run_dir, trace.rank), EVENTS_FILE),
                             f"belongs to job {job!r}, not to this run's job {manifest['job_id']!r} (mixed runs)")
        run.ranks[trace.rank] = trace
    if detail is not None and len(tasks) > len(detail):
        run.problems.append(f"large run: op-level profiler detail kept for ranks {min(detail)}-{max(detail)} "
                            f"of {world} (every rank keeps its phases, buckets and collectives)")
    if run.missing_ranks:
        run.problems.append(f"no trace for ranks {run.missing_ranks}")
        if strict:
            raise TraceError(run_dir, run.problems[-1])
    if not run.ranks:
        raise TraceError(run_dir, "no rank recorded a trace (rank_<r>/events.json missing for every rank)")
    _set_aside_script_profiled(run)
    return run


def _set_aside_script_profiled(run: RunTrace) -> None:
    """Iterations that ran under the script's own profiler on any rank (runtime/script_profiler.py: the ranks
    wait for each other, so every rank's were slower) leave the window's and the clean iterations' statistics
    where others remain; where none remain they stay, and the run says its figures are of the job under it."""
    marked = set().union(*(trace.meta.get("script_profiler_iterations", []) for trace in run.ranks.values()))
    touched, stayed = set(), set()  # "window" / "clean": the sets that had marked iterations, that kept them
    for trace in run.ranks.values():
        window = [i for i in trace.profiled_iterations if i not in marked]
        clean = [i for i in trace.meta.get("clean_iterations", []) if i not in marked]
        for name, before, after in (("window", trace.profiled_iterations, window),
                                    ("clean", trace.meta.get("clean_iterations", []), clean)):
            if len(after) < len(before):
                touched.add(name)
                if not after:
                    stayed.add(name)
        if window:
            trace.profiled_iterations = window
            trace.meta["kineto_iterations"] = [i for i in trace.meta.get("kineto_iterations", []) if i not in marked]
            trace.ops = [op for op in trace.ops if op.iteration not in marked]
            trace.grad_ready = [row for row in trace.grad_ready if row[0] not in marked]
        if clean:
            trace.meta["clean_iterations"] = clean
    if not touched:
        return
    label = {"window": "the profiled window's", "clean": "the clean"}
    text = f"iterations {ranges_text(sorted(marked))} ran (in part) under the script's own profiler"
    left = [label[name] for name in ("window", "clean") if name in touched - stayed]
    clauses = [f"left out of {' and '.join(left)} iterations' statistics"] if left else []
    kept = [label[name] for name in ("window", "clean") if name in stayed]
    if kept:
        clauses.append(f"every one of {' and '.join(kept)} iterations did: they stay, and the figures from them are "
                       "of the job under that profiler")
    text += ": " + "; ".join(clauses)
    run.problems.append(text)


def _map_ranks(tasks: list[tuple[str, int, bool]], workers: Optional[int]) -> list[RankTrace]:
    """Read the ranks, in worker processes for large runs (reading is CPU-bound JSON parsing)."""
    if workers is None:
        workers = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    import multiprocessing

    # fork only: spawn and forkserver re-run the caller's main module, which a script without a __main__ guard
    # cannot survive; without fork the ranks are read here, one after the other
    if workers <= 1 or len(tasks) < PARALLEL_FROM_RANKS or "fork" not in multiprocessing.get_all_start_methods():
        return [_load_one(task) for task in tasks]
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    try:
        with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("fork")) as pool:
            return list(pool.map(_load_one, tasks, chunksize=max(1, len(tasks) // (8 * workers))))
    except (BrokenProcessPool, OSError):  # a worker died (memory, a signal): read them here instead
        return [_load_one(task) for task in tasks]
