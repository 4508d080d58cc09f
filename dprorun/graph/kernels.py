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
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from dprorun.fsutil import UnanswerableError
from dprorun.graph.local import ProfiledOp
from dprorun.replay.engine import GraphBuilder, ReplayGraph, critical_path_report, replay
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
                       [op for op in trace.gpu if op.args.get("correlation") in launched or a <= op.start_us < b])


def kernel_dfg(activity: GPUActivity) -> KernelDFG:
    """The kernel-level local DFG of one iteration (see the module doc)."""
    g = GraphBuilder()
    r, t0 = activity.rank, activity.start_us
    by_correlation = {op.args.get("correlation"): op for op in activity.gpu}
    launch_of = {op.args.get("correlation"): op for op in activity.calls if op.phase == "launch"}
    gpu_ops = sorted((op for c, op in by_correlation.items() if c in launch_of), key=lambda op: op.start_us)
    skipped = len(activity.gpu) - len(gpu_ops)
    call_node: dict[int, int] = {}  # id(call) -> node
    threads = sorted({op.args.get("tid") for op in activity.cpu + activity.calls} - {activity.main_tid}, key=str)
    ends = {tid: _thread_chain(g, r, t0, activity.end_us, tid, activity, call_node) for tid in threads}
    _thread_chain(g, r, t0, activity.end_us, activity.main_tid, activity, call_node,
                  {tid: e for tid, e in ends.items() if e is not None and tid in {op.args.get("tid") for op in
                                                                                   activity.cpu}})
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
    graph = g.build({"source": "kernel-level local DFG", "ranks_built": 1, "world_size": 1})
    return KernelDFG(graph, measured, skipped, notes)


@dataclass
class ThreadEnds:
    start: int  # the thread's delay node (from t0 to its first event)
    last: int  # its last node
    first_us: float
    last_us: float


def _thread_chain(g: GraphBuilder, r: int, t0: float, t1: float, tid, activity: GPUActivity,
                  call_node: dict[int, int], workers: Optional[dict] = None) -> Optional[ThreadEnds]:
    """One thread's chain: a delay to its first event, then segments and runtime calls in time order. The main
    thread (`workers`: the other threads that ran profiled ops, e.g. the autograd engine's) hands work to them
    and waits for them: each worker's chain starts after the main thread's node before the worker's first event
    (its delay then 0), and the main thread's stretch that ends when the worker's last event ends is a wait of
    no duration of its own, after the worker's last node."""
    ops = sorted((op for op in activity.cpu if op.args.get("tid") == tid), key=lambda op: op.start_us)
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
