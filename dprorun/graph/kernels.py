"""The kernel-level local DFG of a GPU rank: its CPU threads and its GPU streams in one iteration, linked through
the CUDA runtime calls that put work on the streams and those that make a thread wait for it.

From a profiler trace (trace/kineto.py: top-level CPU ops per thread, CUDA runtime calls with their correlation
ids, kernels / memcpy / memset per stream), for one iteration window [t0, t1) of one rank:
  CPU      per thread, its time from its first event to its last, cut at its runtime calls: a segment node per
           stretch between two calls (named after the top-level op it lies in: the op that launched the kernel
           after it) and a node per call, chained on the thread's device `rank<r>.thread<tid>`; the thread's first
           node waits from t0 to its first event (a delay, no device).
  GPU      every kernel, memcpy and memset whose launch call lies in the window, on its stream's device
           (`rank<r>.cuda:0/s7`), after its launch call plus the rank's launch latency (a delay: the median, over
           the ops that found the GPU idle, of launch end -> op start) and after the previous op on its stream
           (stream order).
  syncs    a runtime call during which a GPU op it could wait for ended (launched before the call, ended inside
           it: cudaDeviceSynchronize, cudaStreamSynchronize, cudaEventSynchronize, a synchronous cudaMemcpy) waits
           for the latest such op; its own duration is the part of it after that op ended.
  waits    a cudaStreamWaitEvent (the trace names neither its event nor its stream): the thread's next launch
           waits for the latest op launched before the call on another stream that had ended by that launch's
           measured start (a wait the measured times contradict is not linked).
Every node takes its measured duration, so replaying the graph of an iteration gives back its measured timeline
where the dependencies explain it (`KernelReplay.start_error_us`: how far the replayed GPU op starts fall from
the measured ones); passes then answer what-ifs on it (replay/passes.scale_ops on kernel or op names, a faster
GPU as scale_devices on the streams). Not modelled: one thread waiting for another (the autograd engine's thread
for the main thread, and back): each thread keeps its measured time, so a CPU what-if does not move the other
threads.
  gloo     a collective that runs on gloo's worker thread (also for CUDA tensors, through host copies) is on that
           thread's chain; its exchange with the peers (after its cudaStreamSynchronize on CUDA tensors) is a COMM
           node of its own.

The job (`job_kernel_dfg`): every rank's graph of one step in one builder, the k-th NCCL kernel (or gloo
collective) of every rank joined into one collective through a barrier, clocks from the run's alignment or the
collectives' ends; `replay_job_step` replays it with the per-op and per-rank (`scale_rank_gpu`) what-ifs.
"""
from __future__ import annotations

import bisect
import re
from dataclasses import dataclass, field, replace
from typing import Optional

import numpy as np

from dprorun.fsutil import UnanswerableError
from dprorun.graph.local import ProfiledOp
from dprorun.replay.engine import KIND_CODE, GraphBuilder, ReplayGraph, critical_path_report, replay
from dprorun.trace.kineto import KinetoTrace
from dprorun.trace.model import Op, OpKind


@dataclass
class GPUActivity:
    """One rank's CPU ops, CUDA runtime calls and GPU ops in one iteration window."""

    rank: int
    start_us: float
    end_us: float
    main_tid: object  # the thread that runs the step (its chain runs to the window's end)
    cpu: list[Op]  # top-level CPU ops (args["tid"])
    calls: list[Op]  # runtime calls (args["tid"], args["correlation"])
    gpu: list[Op]  # kernels, memcpy, memset (args["correlation"]); NCCL kernels as COMM
    # collectives that run on CPU threads (gloo's workers: args["tid"]); NCCL's CPU-side spans only enqueue
    comm: list[Op] = field(default_factory=list)


@dataclass
class KernelDFG:
    graph: ReplayGraph
    measured_start_us: dict[int, float]  # GPU op node -> its measured start, from t0
    skipped: int  # GPU ops in the window with no launch call in it (launched before the window)
    notes: list[str] = field(default_factory=list)


@dataclass
class KernelReplay:
    step: int
    measured_us: float
    replayed_us: float
    start_error_us: float  # median |replayed - measured| start of the GPU ops
    gpu_busy_us: dict[str, float]
    critical_path: dict
    notes: list[str] = field(default_factory=list)

    @property
    def error(self) -> float:
        return self.replayed_us / self.measured_us - 1.0 if self.measured_us else 0.0


def activity_of_step(trace: KinetoTrace, step: int) -> GPUActivity:
    """The window of profiler step `step` (ProfilerStep#N) in a Kineto trace."""
    window = next(((a, b) for s, a, b in trace.steps if s == step), None)
    if window is None:
        raise UnanswerableError(f"{trace.path}: no ProfilerStep#{step} (steps: {[s for s, _, _ in trace.steps]})")
    a, b = window
    calls = [op for op in trace.runtime if a <= op.start_us < b]
    launched = {op.args.get("correlation") for op in calls if op.phase == "launch"}
    return GPUActivity(int(trace.distributed.get("rank", 0)), a, b, trace.main_tid,
                       [op for op in trace.compute if a <= op.start_us < b], calls,
                       [op for op in trace.gpu if op.args.get("correlation") in launched or a <= op.start_us < b],
                       [op for op in trace.collectives if op.stream.startswith("comm:") and op.name.startswith("gloo:")
                        and a <= op.start_us < b])


def kernel_dfg(activity: GPUActivity) -> KernelDFG:
    """The kernel-level local DFG of one iteration (see the module doc)."""
    g = GraphBuilder()
    built = _rank_nodes(g, activity)
    graph = g.build({"source": "kernel-level local DFG", "ranks_built": 1, "world_size": 1})
    return KernelDFG(graph, built.measured, built.skipped, built.notes)


@dataclass
class RankNodes:
    """What one rank's kernel-level DFG put into a shared builder."""

    first: int  # its first node: nodes [first, end) are the rank's
    end: int
    measured: dict[int, float]  # GPU op node -> its measured start, from the rank's t0
    comm: list[tuple[int, Op]]  # NCCL kernels (node, op) in launch order
    cpu_comm: list[tuple[int, Op]]  # collectives on CPU threads (the node of their start), in start order
    skipped: int
    notes: list[str]


def _rank_nodes(g: GraphBuilder, activity: GPUActivity) -> RankNodes:
    """One rank's kernel-level DFG appended to g."""
    first = g.size
    r, t0 = activity.rank, activity.start_us
    by_correlation = {op.args.get("correlation"): op for op in activity.gpu}
    launch_of = {op.args.get("correlation"): op for op in activity.calls if op.phase == "launch"}
    gpu_ops = sorted((op for c, op in by_correlation.items() if c in launch_of), key=lambda op: op.start_us)
    skipped = len(activity.gpu) - len(gpu_ops)
    call_node: dict[int, int] = {}  # id(call) -> node
    comm_node: dict[int, int] = {}  # id(CPU collective) -> node
    threads = sorted({op.args.get("tid") for op in activity.cpu + activity.calls + activity.comm}
                     - {activity.main_tid}, key=str)
    ends = {tid: _thread_chain(g, r, t0, activity.end_us, tid, activity, call_node, comm_node) for tid in threads}
    _thread_chain(g, r, t0, activity.end_us, activity.main_tid, activity, call_node, comm_node,
                  {tid: e for tid, e in ends.items() if e is not None and tid in {op.args.get("tid") for op in
                                                                                   activity.cpu + activity.comm}})
    # GPU ops: after their launch call (and the launch latency) and the previous op on their stream
    latency = launch_latency_us(gpu_ops, launch_of)
    measured, last_on_stream = {}, {}
    gpu_node: dict[int, int] = {}
    for op in gpu_ops:
        kind = "COMM" if op.kind is OpKind.COMM else ("IO" if op.kind is OpKind.IO else op.kind.value)
        delay = g.op(f"r{r}.launch latency", "VIRTUAL", r, None, latency)
        g.edge(call_node[id(launch_of[op.args.get("correlation")])], delay)
        node = g.op(f"r{r}.{op.stream}:{op.name[:80]}", kind, r, f"rank{r}.{op.stream}", op.end_us - op.start_us,
                    parts=((ProfiledOp(op.name, kind, "", 0.0, 1.0), 1.0),))
        g.edge(delay, node)
        if op.stream in last_on_stream:
            g.edge(last_on_stream[op.stream], node)
        last_on_stream[op.stream] = node
        measured[node] = op.start_us - t0
        gpu_node[id(op)] = node
    notes = _link_waits(g, activity, gpu_ops, launch_of, call_node, gpu_node)
    notes.append(f"launch latency {latency:.1f} us (median over the GPU ops that found the GPU idle)")
    if skipped:
        notes.append(f"{skipped} GPU ops of the window were launched before it: left out")
    comm = sorted(((gpu_node[id(op)], op) for op in gpu_ops if op.kind is OpKind.COMM and NCCL_KIND.search(op.name)),
                  key=lambda item: launch_of[item[1].args.get("correlation")].start_us)
    cpu_comm = sorted(((comm_node[id(op)], op) for op in activity.comm if id(op) in comm_node),
                      key=lambda item: item[1].start_us)
    return RankNodes(first, g.size, measured, comm, cpu_comm, skipped, notes)


@dataclass
class ThreadEnds:
    start: int  # the thread's delay node (from t0 to its first event)
    last: int  # its last node
    first_us: float
    last_us: float


def _thread_chain(g: GraphBuilder, r: int, t0: float, t1: float, tid, activity: GPUActivity,
                  call_node: dict[int, int], comm_node: dict[int, int],
                  workers: Optional[dict] = None) -> Optional[ThreadEnds]:
    """One thread's chain: a delay to its first event, then segments and runtime calls in time order. The main
    thread (`workers`: the other threads that ran profiled ops, e.g. the autograd engine's) hands work to them
    and waits for them: each worker's chain starts after the main thread's node before the worker's first event
    (its delay then 0), and the main thread's stretch that ends when the worker's last event ends is a wait of
    no duration of its own, after the worker's last node."""
    ops = sorted((op for op in activity.cpu + activity.comm if op.args.get("tid") == tid), key=lambda op: op.start_us)
    calls = sorted((op for op in activity.calls if op.args.get("tid") == tid), key=lambda op: op.start_us)
    if not ops and not calls and workers is None:
        return None
    device = f"rank{r}.thread{tid}"
    starts = [op.start_us for op in ops]
    first = min([op.start_us for op in ops[:1]] + [op.start_us for op in calls[:1]] + [t1])
    last = max([op.end_us for op in ops] + [op.end_us for op in calls] + [first])
    if workers is not None:
        last = max(last, t1)  # the thread that runs the step runs to its end
    chain = [g.op(f"r{r}.thread{tid}.start", "VIRTUAL", r, None, first - t0)]
    cursor = first

    def segment(until: float, wait: bool = False) -> None:
        if until - cursor <= 0 and not wait:
            return
        k = bisect.bisect_right(starts, cursor) - 1
        inside = ops[k].name if k >= 0 and ops[k].end_us > cursor else "(between ops)"
        kind = ops[k].kind.value if k >= 0 and ops[k].end_us > cursor else "OTHER"
        kind = kind if kind != "COMM" else "OTHER"
        chain.append(g.op(f"r{r}.thread{tid}:{inside}" + (" (waits)" if wait else ""), kind, r, device,
                          0.0 if wait else max(0.0, until - cursor),
                          parts=((ProfiledOp(inside, kind, "", 0.0, 1.0), 1.0),)))

    marks = [(call.start_us, 0, call) for call in calls]
    # a collective on this thread (gloo's worker): its exchange with the peers is a node of its own, the one that
    # waits for them: on CUDA tensors the stretch after its cudaStreamSynchronize (the copy to the host has landed)
    # up to its next runtime call (the copy back); otherwise its stretch up to its first runtime call, or its end
    call_starts = sorted(call.start_us for call in calls)
    for op in ops:
        if op.kind is OpKind.COMM:
            sync = next((call for call in calls if call.name == "cudaStreamSynchronize"
                         and op.start_us <= call.start_us < op.end_us), None)
            begin = sync.end_us if sync is not None else op.start_us
            k = bisect.bisect_right(call_starts, begin) if sync is not None else bisect.bisect_left(call_starts, begin)
            marks.append((begin, 3, (op, min(op.end_us, call_starts[k] if k < len(call_starts) else op.end_us))))
    for other, ends in (workers or {}).items():
        if first <= ends.first_us and ends.last_us <= last:
            marks += [(ends.first_us, 1, ends), (ends.last_us, 2, ends)]
    for at, what, item in sorted(marks, key=lambda m: (m[0], m[1])):
        if what == 1:  # hand-off: the worker starts after the main thread's node before this point
            segment(at)
            cursor = max(cursor, at)
            g.durations[item.start] = 0.0
            g.edge(chain[-1], item.start)
        elif what == 2:  # the main thread waits for the worker's last node
            segment(at, wait=True)
            g.edge(item.last, chain[-1])
            cursor = max(cursor, at)
        elif what == 3:  # a collective's exchange with its peers
            op, until = item
            segment(at)
            cursor = max(cursor, at)
            node = g.op(f"r{r}.thread{tid}:{op.name}", "COMM", r, device, max(0.0, until - cursor),
                        parts=((ProfiledOp(op.name, "COMM", "", 0.0, 1.0), 1.0),))
            chain.append(node)
            comm_node[id(op)] = node
            cursor = max(cursor, until)
        else:
            segment(at)
            node = g.op(f"r{r}.thread{tid}.{item.name}", "QUEUE", r, device, item.end_us - item.start_us)
            chain.append(node)
            call_node[id(item)] = node
            cursor = max(cursor, item.end_us)
    segment(last)
    g.chain(chain)
    return ThreadEnds(chain[0], chain[-1], first, last)


def launch_latency_us(gpu_ops: list[Op], launch_of: dict) -> float:
    """From a launch call's end to its GPU op's start, where the GPU was idle by then (no op of any stream still
    running: an op that found only its own stream idle may wait for another's, through an event); median."""
    busy_until = float("-inf")
    gaps = []
    for op in sorted(gpu_ops, key=lambda op: launch_of[op.args.get("correlation")].end_us):
        launched = launch_of[op.args.get("correlation")].end_us
        if busy_until <= launched:
            gaps.append(max(0.0, op.start_us - launched))
        busy_until = max(busy_until, op.end_us)
    return float(np.median(gaps)) if gaps else 0.0


def _stream_wait(call: Op, before: list[Op], by_launch: list[Op], launch_times: list[float],
                 launch_of: dict) -> Optional[tuple[Op, Op]]:
    """(the op waited for, the op that waits) of a cudaStreamWaitEvent. The trace names neither the event nor the
    stream: the waiting op is the thread's next launch after the call; the op waited for, the last op launched
    on another stream before the call that had ended by the waiting op's start (the latest such: a wait the
    measured times contradict, an op that started while the other was still running, is not one)."""
    tid = call.args.get("tid")
    nxt = next((op for op, t in zip(by_launch, launch_times) if t > call.end_us
                and launch_of[op.args.get("correlation")].args.get("tid") == tid), None)
    if nxt is None:
        return None
    last: dict[str, Op] = {}
    for op in before:
        last[op.stream] = op
    candidates = [op for stream, op in last.items() if stream != nxt.stream and op.end_us <= nxt.start_us + 1.0]
    return (max(candidates, key=lambda op: op.end_us), nxt) if candidates else None


def _link_waits(g: GraphBuilder, activity: GPUActivity, gpu_ops: list[Op], launch_of: dict, call_node: dict,
                gpu_node: dict) -> list[str]:
    """Sync calls wait for the GPU op that ended while they ran; a stream wait makes the thread's next launch
    wait for the other streams' last ops (see the module doc). A sync's own duration becomes its part after
    that op ended."""
    launched_at = [launch_of[op.args.get("correlation")].start_us for op in gpu_ops]
    order = np.argsort(launched_at, kind="stable")
    by_launch = [gpu_ops[k] for k in order]
    launch_times = [launched_at[k] for k in order]
    synced, waits = 0, 0
    for call in activity.calls:
        if call.phase != "sync":
            continue
        before = by_launch[:bisect.bisect_left(launch_times, call.start_us)]
        if call.name == "cudaStreamWaitEvent":
            pair = _stream_wait(call, before, by_launch, launch_times, launch_of)
            if pair is not None:
                g.edge(gpu_node[id(pair[0])], gpu_node[id(pair[1])])
                waits += 1
            continue
        ended = [op for op in before if call.start_us < op.end_us <= call.end_us + 1.0]
        if not ended:
            continue
        dep = max(ended, key=lambda op: op.end_us)
        node = call_node[id(call)]
        g.edge(gpu_node[id(dep)], node)
        g.durations[node] = max(0.0, call.end_us - max(call.start_us, dep.end_us))
        synced += 1
    return [f"{synced} runtime calls waited for the GPU, {waits} stream waits linked"]


def replay_step(trace: KinetoTrace, step: int, op_scale: Optional[dict[str, float]] = None) -> KernelReplay:
    """Replay one profiler step's kernel-level DFG (with `op_scale`, the per-op what-if on it)."""
    from dprorun.replay.passes import scale_ops

    dfg = kernel_dfg(activity_of_step(trace, step))
    graph, matched = scale_ops(dfg.graph, op_scale or {})
    missing = set(op_scale or {}) - matched
    if missing:
        raise UnanswerableError(f"--op-scale: no op or kernel matches {sorted(missing)}")
    result = replay(graph)
    errors = [abs(result.start_us[n] - t) for n, t in dfg.measured_start_us.items()]
    busy = {d: round(us, 1) for d, us in result.device_busy_us.items() if ".cuda:" in d}
    step_us = next(b - a for s, a, b in trace.steps if s == step)
    start_error = float(np.median(errors)) if errors else 0.0
    notes = list(dfg.notes)
    if start_error > UNEXPLAINED_START_US:
        waits = sum(1 for call in trace.runtime if call.phase == "sync")
        notes.append(f"warning: the launches, stream order and waits do not explain where the GPU ops started "
                     f"(replayed {start_error:.0f} us from their measured starts, median)"
                     + (": the trace holds no synchronize or stream-wait calls (filtered or sampled?)" if not waits
                        else "") + "; the replay's GPU timing and its what-ifs are not backed by this trace")
    return KernelReplay(step, step_us, result.iteration_time_us, start_error, busy,
                        critical_path_report(graph, result, top=10), notes)


UNEXPLAINED_START_US = 100.0  # median start error of the replayed GPU ops beyond which the graph is said unfit


# ---- the job: every rank's kernel-level DFG joined through its NCCL kernels ---------------------------------------
NCCL_KIND = re.compile(r"nccl(?:Dev)?Kernel_([A-Za-z]+)")


@dataclass
class Collective:
    """The k-th NCCL kernel of the step on every rank: one collective (or one send/recv pair)."""

    index: int
    kind: str  # AllReduce, Broadcast, AllGather, ReduceScatter, SendRecv, ...
    nodes: list[int]  # per rank (in the order of the traces)
    own_ready: list[list[int]]  # per rank: the nodes the rank's kernel waited for on its own rank
    transfer_us: float  # the shortest of the ranks' kernels: the one that found every peer there
    waited_us: list[float]  # per rank: its kernel's measured duration less the transfer (waiting for peers)


@dataclass
class JobKernelDFG:
    graph: ReplayGraph
    ranks: list[int]
    measured_start_us: dict[int, float]  # GPU op node -> its measured start on rank 0's clock, from the job's t0
    measured_us: float  # the step on the aligned clocks: the first rank's start to the last rank's end
    offsets_us: list[float]  # per rank: add to its clock to read rank 0's (from the collectives' ends)
    offset_uncertainty_us: list[float]  # per rank: the largest disagreement of one collective with the offset
    collectives: list[Collective]
    notes: list[str] = field(default_factory=list)


@dataclass
class JobKernelReplay:
    step: int
    ranks: list[int]
    measured_us: float
    replayed_us: float
    offsets_us: list[float]
    offset_uncertainty_us: list[float]
    start_error_us: list[float]  # per rank: median |replayed - measured| start of its GPU ops (aligned clocks)
    collectives: int
    waited_measured_us: list[float]  # per rank: time its NCCL kernels spent waiting for peers, as measured
    waited_replayed_us: list[float]  # ... and as replayed
    critical_path: dict
    notes: list[str] = field(default_factory=list)

    @property
    def error(self) -> float:
        return self.replayed_us / self.measured_us - 1.0 if self.measured_us else 0.0

    def to_json(self) -> dict:
        return {"step": self.step, "ranks": self.ranks, "measured_ms": round(self.measured_us / 1000, 3),
                "replayed_ms": round(self.replayed_us / 1000, 3),
                "offsets_us": [round(x, 1) for x in self.offsets_us],
                "offset_uncertainty_us": [round(x, 1) for x in self.offset_uncertainty_us],
                "gpu_start_error_us": [round(x, 1) for x in self.start_error_us], "collectives": self.collectives,
                "waited_in_collectives_ms": {"measured": [round(x / 1000, 3) for x in self.waited_measured_us],
                                             "replayed": [round(x / 1000, 3) for x in self.waited_replayed_us]},
                "critical_path": self.critical_path, "notes": self.notes}


def nccl_kind(name: str) -> str:
    found = NCCL_KIND.search(name)
    return found.group(1) if found else name.split("(")[0]


def job_kernel_dfg(traces: list[KinetoTrace], step: int, clock_offsets_us: Optional[dict[int, float]] = None,
                   clock_source: str = "") -> JobKernelDFG:
    """One step of a multi-GPU job as one graph: each rank's kernel-level DFG (see the module doc), the k-th NCCL
    kernel of every rank joined into one collective: it starts on every rank once every rank's kernel could have
    started (its launch and its stream), and lasts the shortest of the ranks' measured kernels (the rank that
    arrived last waited for nobody). Collectives that run on CPU threads (gloo's workers, also for CUDA tensors)
    are joined the same way, k-th with k-th, through the node of their exchange. The ranks' clocks are aligned on
    the collectives' ends (a collective ends on every rank at nearly one moment); each rank starts the step where
    its aligned clock says. `clock_offsets_us` (rank -> add to its clock; a run's alignment.json, from
    `clock_source`) replaces the collectives' estimate where it holds every rank."""
    activities = [activity_of_step(trace, step) for trace in traces]
    ranks = [a.rank for a in activities]
    if len(set(ranks)) != len(ranks):
        raise UnanswerableError(f"the traces name ranks {ranks}: one trace per rank is needed (distributedInfo.rank)")
    g = GraphBuilder()
    built = [_rank_nodes(g, activity) for activity in activities]
    joined, kinds = _pair_collectives(built, ranks, step)
    estimated, _ = _offsets_from_ends(joined)
    given = clock_offsets_us is not None and all(r in clock_offsets_us for r in ranks)
    chosen = [clock_offsets_us[r] - clock_offsets_us[ranks[0]] for r in ranks] if given else None
    offsets, uncertainty = _offsets_from_ends(joined, chosen)
    aligned_start = [a.start_us + off for a, off in zip(activities, offsets)]
    job_t0 = min(aligned_start)
    measured_us = max(a.end_us + off for a, off in zip(activities, offsets)) - job_t0
    # each rank starts the step where its aligned clock says: a delay before its first nodes
    has_pred = np.zeros(g.size, dtype=bool)
    has_pred[np.asarray(g.dst, dtype=np.int64)] = True
    for r, b, start in zip(ranks, built, aligned_start):
        delay = g.op(f"r{r}.step start", "VIRTUAL", r, None, start - job_t0)
        for node in range(b.first, b.end):
            if not has_pred[node]:
                g.edge(delay, node)
    collectives = _join_collectives(g, joined, kinds)
    measured = {node: t + start - job_t0 for b, start in zip(built, aligned_start) for node, t in b.measured.items()}
    notes = [f"rank {r}: {note}" for r, b in zip(ranks, built) for note in b.notes]
    world = max(int(t.distributed.get("world_size", 0) or 0) for t in traces)
    if world > len(traces):
        notes.append(f"warning: {len(traces)} of the job's {world} ranks given: their collectives also waited for "
                     "ranks that are not here, so each collective's transfer (the shortest of the given ranks' "
                     "kernels) may hold waiting, and its peers may not be these ranks")
    notes += _clock_notes(ranks, offsets, estimated, max(uncertainty), len(collectives),
                          (clock_source or "the offsets given") if given else None)
    graph = g.build({"source": "kernel-level global DFG", "ranks_built": len(ranks), "world_size": len(ranks)})
    return JobKernelDFG(graph, ranks, measured, measured_us, offsets, uncertainty, collectives, notes)


def _pair_collectives(built: list[RankNodes], ranks: list[int], step: int) -> tuple[list[list[tuple[int, Op]]],
                                                                                   list[str]]:
    """Per rank, its collectives (NCCL kernels, then gloo's) to be joined k-th with k-th, and their kinds; ranks
    whose collectives do not pair up one to one are refused."""
    joined: list[list[tuple[int, Op]]] = [[] for _ in built]
    kinds: list[str] = []
    for family, items, kind_of in (("NCCL kernels", lambda b: b.comm, nccl_kind),
                                   ("collectives on CPU threads", lambda b: b.cpu_comm, lambda name: name)):
        sequences = [[kind_of(op.name) for _, op in items(b)] for b in built]
        if any(seq != sequences[0] for seq in sequences):
            shown = "; ".join(f"rank {r}: {len(seq)} ({', '.join(sorted(set(seq)))})"
                              for r, seq in zip(ranks, sequences))
            raise UnanswerableError(f"step {step}: the ranks' {family} do not pair up one to one ({shown}): the "
                                    "traces are of different steps or jobs, or filtered/sampled; a job-level replay "
                                    "needs every rank's full trace of the same step")
        for i, b in enumerate(built):
            joined[i] += items(b)
        kinds += sequences[0]
    if not kinds:
        raise UnanswerableError(f"step {step}: no collective (NCCL kernel, or gloo's on its threads) in the step: "
                                "nothing joins the ranks; replay each rank alone")
    return joined, kinds


def _offsets_from_ends(joined: list[list[tuple[int, Op]]],
                       offsets: Optional[list[float]] = None) -> tuple[list[float], list[float]]:
    """(per rank, the offset onto the first rank's clock, the largest disagreement of one collective's end with
    it): every collective ends at one moment on every rank, so the offset is the median difference of the ends,
    unless `offsets` are given (then only their disagreement is measured)."""
    chosen, disagreement = [], []
    for k, mine in enumerate(joined):
        diffs = np.array([op0.end_us - op.end_us for (_, op0), (_, op) in zip(joined[0], mine)])
        offset = offsets[k] if offsets is not None else float(np.median(diffs))
        chosen.append(offset)
        disagreement.append(float(np.max(np.abs(diffs - offset))))
    return chosen, disagreement


def _join_collectives(g: GraphBuilder, joined: list[list[tuple[int, Op]]], kinds: list[str]) -> list[Collective]:
    """The k-th collective of every rank: a barrier after each rank's own predecessors of it, each rank's node after
    the barrier lasting the shortest rank's measured one."""
    comm_nodes = {node for mine in joined for node, _ in mine}
    preds: dict[int, list[int]] = {}
    for u, v in zip(g.src, g.dst):
        if v in comm_nodes:
            preds.setdefault(v, []).append(u)
    collectives = []
    for k, kind in enumerate(kinds):
        nodes = [mine[k][0] for mine in joined]
        durations = [g.durations[node] for node in nodes]
        transfer = min(durations)
        barrier = g.op(f"collective {k} {kind}", "VIRTUAL", -1, None, 0.0)
        for node in nodes:
            for p in preds.get(node, []):
                g.edge(p, barrier)
            g.edge(barrier, node)
            g.durations[node] = transfer
        collectives.append(Collective(k, kind, nodes, [preds.get(node, []) for node in nodes], transfer,
                                      [d - transfer for d in durations]))
    return collectives


def _clock_notes(ranks: list[int], offsets: list[float], estimated: list[float], worst: float, collectives: int,
                 given_by: Optional[str]) -> list[str]:
    """What the replay's clocks rest on: the offsets given (and what the collectives' ends would say), or the
    collectives' ends (a warning where they disagree with one offset by more than OFFSET_UNCERTAIN_US)."""
    shown = ", ".join(f"rank {r} {off:+.1f} us" for r, off in zip(ranks, offsets))
    if given_by is not None:
        return [f"clocks from {given_by}: {shown}; the {collectives} collectives' ends, each within {worst:.1f} us "
                "of them, would say " + ", ".join(f"{off:+.1f}" for off in estimated)]
    notes = [f"clocks aligned on the ends of {collectives} collectives per rank: offsets {shown} (each collective "
             f"within {worst:.1f} us of them)"]
    if worst > OFFSET_UNCERTAIN_US:
        notes.append(f"warning: the collectives' ends disagree with one offset by up to {worst:.0f} us (not ring "
                     "collectives that end together, or a clock that drifted): the ranks' relative timing is "
                     "uncertain by that much")
    return notes


OFFSET_UNCERTAIN_US = 50.0


def scale_rank_gpu(graph: ReplayGraph, factors: dict[int, float]) -> ReplayGraph:
    """The what-if of a slower or faster GPU on some ranks: rank r's GPU compute ops (kernels, memcpy, memset; not
    its NCCL kernels, whose transfer every rank shares) x factors[r]."""
    durations = graph.durations.copy()
    gpu_device = np.array([".cuda:" in name for name in graph.device_names] + [False])
    on_gpu = gpu_device[graph.devices]  # index -1 (no device) reads the False at the end
    for rank, factor in factors.items():
        chosen = on_gpu & (graph.ranks == rank) & (graph.kinds != KIND_CODE["COMM"])
        durations[chosen] *= factor
    return replace(graph, durations=durations)


def replay_job_step(traces: list[KinetoTrace], step: int, op_scale: Optional[dict[str, float]] = None,
                    rank_scale: Optional[dict[int, float]] = None, clock_offsets_us: Optional[dict[int, float]] = None,
                    clock_source: str = "") -> JobKernelReplay:
    """Replay one step of a multi-GPU job's kernel-level global DFG (with the per-op and per-rank what-ifs)."""
    from dprorun.replay.passes import scale_ops

    dfg = job_kernel_dfg(traces, step, clock_offsets_us, clock_source)
    graph, matched = scale_ops(dfg.graph, op_scale or {})
    missing = set(op_scale or {}) - matched
    if missing:
        raise UnanswerableError(f"--op-scale: no op or kernel matches {sorted(missing)}")
    unknown = set(rank_scale or {}) - set(dfg.ranks)
    if unknown:
        raise UnanswerableError(f"--rank-scale: no trace of rank(s) {sorted(unknown)} (ranks: {dfg.ranks})")
    graph = scale_rank_gpu(graph, rank_scale or {})
    result = replay(graph)
    errors: dict[int, list[float]] = {r: [] for r in dfg.ranks}
    for node, t in dfg.measured_start_us.items():
        errors[int(graph.ranks[node])].append(abs(result.start_us[node] - t))
    start_error = [float(np.median(errors[r])) if errors[r] else 0.0 for r in dfg.ranks]
    waited_replayed = [0.0] * len(dfg.ranks)
    for c in dfg.collectives:
        for i, (node, own) in enumerate(zip(c.nodes, c.own_ready)):
            ready = max((result.end_us[p] for p in own), default=0.0)
            waited_replayed[i] += max(0.0, float(result.start_us[node] - ready))
    waited_measured = [sum(c.waited_us[i] for c in dfg.collectives) for i in range(len(dfg.ranks))]
    notes = list(dfg.notes)
    if max(start_error) > UNEXPLAINED_START_US:
        notes.append(f"warning: the launches, stream order, waits and collectives do not explain where the GPU ops "
                     f"started (replayed up to {max(start_error):.0f} us from their measured starts, median per "
                     "rank); the replay's GPU timing and its what-ifs are not backed by these traces")
    return JobKernelReplay(step, dfg.ranks, dfg.measured_us, result.iteration_time_us, dfg.offsets_us,
                           dfg.offset_uncertainty_us, start_error, len(dfg.collectives), waited_measured,
                           waited_replayed, critical_path_report(graph, result, top=10), notes)


KERNEL_LEVEL_MAX_RANKS = 8  # beyond: the job-level model alone (a kernel-level graph per step grows with ranks)


def kernel_level_of_run(run, offsets_us: dict[int, float], clock_source: str) -> Optional[dict]:
    """The profiled steps of a GPU run as kernel-level global DFGs (every rank's profiler trace as read, kept by
    load_rank): per step measured vs replayed, and what the ranks waited for each other; None where a rank has no
    GPU trace or the run has more than KERNEL_LEVEL_MAX_RANKS ranks."""
    traces = [trace.kineto for _, trace in sorted(run.ranks.items())]
    if len(traces) < 2 or len(traces) > KERNEL_LEVEL_MAX_RANKS or any(t is None for t in traces):
        return None
    steps = sorted(set.intersection(*({s for s, _, _ in t.steps} for t in traces)))
    rows, skipped = [], []
    for step in steps:
        try:
            rows.append(replay_job_step(traces, step, clock_offsets_us=offsets_us, clock_source=clock_source))
        except UnanswerableError as exc:
            skipped.append(str(exc))
    if not rows:
        return {"steps": [], "skipped": skipped}
    errors = [abs(r.error) for r in rows]
    return {"steps": [r.to_json() for r in rows], "skipped": skipped,
            "median_abs_error_pct": round(100 * float(np.median(errors)), 2),
            "max_abs_error_pct": round(100 * max(errors), 2)}
