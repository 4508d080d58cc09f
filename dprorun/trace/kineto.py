"""Reader of PyTorch profiler (Kineto) Chrome-trace JSON into trace-model ops.

Produces, in epoch microseconds (``baseTimeNanoseconds`` + ``ts`` where the base is present, ``ts`` otherwise):
  - top-level CPU ops of the main (Python) thread: the compute ops of the local DFG;
  - collective spans (``gloo:*`` on pt_gloo_runloop threads, ``nccl:*`` annotations): transmission, kind COMM;
  - GPU activity (CUPTI kernels, memcpy, memset) per device stream, NCCL kernels as COMM; each kernel's kind is
    the kind of the CPU op that launched it (matched through the ``correlation`` id of its runtime call);
  - ``ProfilerStep#N`` annotations as iteration markers, and ``distributedInfo`` (backend, rank, world size).
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any, Optional

from dprorun.fsutil import TraceError, read_json
from dprorun.trace.model import Op, OpKind

GPU_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}
# CUDA runtime calls the kernel-level DFG needs (graph/kernels.py): those that put work on a stream, those that
# make the calling thread wait for the GPU, and the GPU-side wait of one stream for another
LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cudaLaunchCooperativeKernel", "cudaMemcpyAsync",
                "cudaMemsetAsync", "cudaMemcpy2DAsync", "cuLaunchKernel", "cuLaunchKernelEx")
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
              "cudaMemcpy2D", "cudaMemset", "cudaStreamWaitEvent")
COMM_PREFIXES = ("gloo:", "nccl:", "mpi:", "ucc:")


@dataclass
class KinetoTrace:
    path: str
    base_us: float
    distributed: dict[str, Any]
    host: str
    main_tid: Any
    compute: list[Op] = field(default_factory=list)
    collectives: list[Op] = field(default_factory=list)
    gpu: list[Op] = field(default_factory=list)
    runtime: list[Op] = field(default_factory=list)  # CUDA runtime calls: LAUNCH_CALLS and SYNC_CALLS
    steps: list[tuple[int, float, float]] = field(default_factory=list)
    annotations: list[Op] = field(default_factory=list)


def name_kind(name: str) -> OpKind:
    """Kind of a CPU op from its name alone (used where the hooks' phase spans are not available)."""
    lowered = name.lower()
    if name.startswith("autograd::engine::evaluate_function") or "backward" in lowered:
        return OpKind.BW
    if name.startswith("Optimizer.") or "optimizer" in lowered:
        return OpKind.UPDATE
    if name.startswith(COMM_PREFIXES) or name.startswith("c10d::") or "nccl" in lowered:
        return OpKind.COMM
    if name.startswith(("aten::copy_", "aten::to", "aten::_to_copy")) or "dataloader" in lowered:
        return OpKind.IO
    return OpKind.FW


def read_kineto(path: str, rank: Optional[int] = None, detail: bool = True) -> KinetoTrace:
    """The profiler trace in the trace model; `detail=False` keeps only what the job-level analysis needs from
    every rank of a large run (collective spans, step marks), not its op-level compute and GPU activity."""
    doc = read_json(path)
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        raise TraceError(path, "not a PyTorch profiler trace (no traceEvents list)")
    base_ns = doc.get("baseTimeNanoseconds")
    base_us = float(base_ns) / 1000.0 if isinstance(base_ns, (int, float)) else 0.0
    dist = doc.get("distributedInfo") or {}
    if rank is None:
        rank = int(dist.get("rank", 0))
    events = [e for e in doc["traceEvents"] if isinstance(e, dict) and e.get("ph") == "X"]
    for event in events:
        if not isinstance(event.get("ts"), (int, float)) or not isinstance(event.get("dur", 0), (int, float)):
            raise TraceError(path, f"event {event.get('name')!r} has a non-numeric ts/dur")
    main_tid = _main_thread(doc["traceEvents"], events) if detail else None
    trace = KinetoTrace(path, base_us, dist, str(doc.get("host_name", "")), main_tid)

    def span(event) -> tuple[float, float]:
        start = base_us + float(event["ts"])
        return start, start + float(event.get("dur", 0.0))

    # compute: top-level CPU ops of the main thread, and of autograd engine threads (backward on GPU jobs)
    by_thread: dict[Any, list] = {}
    for event in events if detail else ():
        if event.get("cat") == "cpu_op":
            by_thread.setdefault(event.get("tid"), []).append(event)
    for tid, thread_events in by_thread.items():
        is_main = tid == main_tid
        if not is_main and not any(str(e.get("name", "")).startswith("autograd::engine::evaluate_function")
                                   for e in thread_events):
            continue
        top_end = float("-inf")
        for event in sorted(thread_events, key=lambda e: e["ts"]):
            start, end = span(event)
            if start < top_end:
                continue  # nested in the previous top-level op
            top_end = end
            name = str(event.get("name", ""))
            kind = name_kind(name) if is_main else OpKind.BW  # autograd engine threads run backward only
            trace.compute.append(Op(name=name, kind=kind, rank=rank, start_us=start, end_us=end,
                                    stream="main" if is_main else f"autograd:{tid}", source="kineto",
                                    args={"tid": tid}))
    trace.compute.sort(key=lambda op: op.start_us)
    launches: dict[Any, float] = {}
    for event in events:
        cat = event.get("cat")
        if not detail and cat not in ("user_annotation", "gpu_user_annotation"):
            continue
        name = str(event.get("name", ""))
        args = event.get("args") or {}
        if cat == "cuda_runtime" and "correlation" in args:
            launches[args["correlation"]] = (event.get("tid"), span(event)[0])
            if name in LAUNCH_CALLS or name in SYNC_CALLS:
                trace.runtime.append(_runtime_call(event, span(event), rank))
        elif cat in ("user_annotation", "gpu_user_annotation") and name.startswith(COMM_PREFIXES):
            start, end = span(event)
            stream = "gpu" if cat == "gpu_user_annotation" else f"comm:{event.get('tid')}"
            trace.collectives.append(Op(name=name, kind=OpKind.COMM, rank=rank, start_us=start, end_us=end,
                                        stream=stream, source="kineto", phase="transmit",
                                        granularity="collective", nbytes=_bytes_from_dims(args),
                                        args={"tid": event.get("tid")}))
        elif cat == "user_annotation" and name.startswith("ProfilerStep#"):
            start, end = span(event)
            try:
                trace.steps.append((int(name.split("#", 1)[1]), start, end))
            except ValueError:
                pass
        elif cat == "user_annotation" and event.get("tid") == main_tid:
            start, end = span(event)
            trace.annotations.append(Op(name=name, kind=name_kind(name), rank=rank, start_us=start,
                                        end_us=end, source="kineto"))
    trace.collectives.sort(key=lambda op: op.start_us)
    trace.runtime.sort(key=lambda op: op.start_us)
    trace.steps.sort()
    if detail:
        _read_gpu(trace, events, launches, span, rank)
    return trace


def _runtime_call(event: dict, span: tuple[float, float], rank: int) -> Op:
    """A CUDA runtime call the kernel-level DFG needs: a launch, or a call that may wait (phase "sync")."""
    name = str(event.get("name", ""))
    return Op(name=name, kind=OpKind.QUEUE, rank=rank, start_us=span[0], end_us=span[1],
              stream=f"thread:{event.get('tid')}", source="kineto", phase="launch" if name in LAUNCH_CALLS else "sync",
              args={"tid": event.get("tid"), "correlation": (event.get("args") or {}).get("correlation")})


def _read_gpu(trace: KinetoTrace, events: list, launches: dict, span, rank: int) -> None:
    per_thread: dict[Any, list[Op]] = {}
    for op in trace.compute:
        per_thread.setdefault(op.args.get("tid"), []).append(op)
    starts = {tid: [op.start_us for op in ops] for tid, ops in per_thread.items()}
    for event in events:
        if event.get("cat") not in GPU_CATEGORIES:
            continue
        args = event.get("args") or {}
        name = str(event.get("name", ""))
        start, end = span(event)
        device = args.get("device", 0)
        stream = f"cuda:{device}/s{args.get('stream', event.get('tid'))}"
        if "nccl" in name.lower():
            kind, phase = OpKind.COMM, "transmit"
        else:
            kind, phase = OpKind.FW, ""
            tid, launched = launches.get(args.get("correlation"), (None, None))
            if launched is not None and tid in starts:
                index = bisect.bisect_right(starts[tid], launched) - 1
                if index >= 0 and per_thread[tid][index].end_us >= launched:
                    kind = per_thread[tid][index].kind
            if event.get("cat") != "kernel" and kind is OpKind.FW:
                kind = OpKind.IO
        trace.gpu.append(Op(name=name, kind=kind, rank=rank, start_us=start, end_us=end, stream=stream,
                            device=f"cuda:{device}", source="kineto", phase=phase,
                            args={"correlation": args.get("correlation")}))
    trace.gpu.sort(key=lambda op: op.start_us)


def _bytes_from_dims(args: dict) -> int:
    dims = args.get("Input Dims")
    types = args.get("Input type") or []
    if not dims or not isinstance(dims, list) or not isinstance(dims[0], list):
        return 0
    numel = 1
    for d in dims[0]:
        if not isinstance(d, int):
            return 0
        numel *= d
    size = {"float": 4, "c10::Half": 2, "c10::BFloat16": 2, "double": 8, "int": 4, "long int": 8}
    return numel * size.get(types[0] if types else "float", 4)


def _main_thread(raw_events: list, events: list) -> Any:
    names = {}
    for event in raw_events:
        if isinstance(event, dict) and event.get("ph") == "M" and event.get("name") == "thread_name":
            names[event.get("tid")] = str((event.get("args") or {}).get("name", ""))
    counts: dict[Any, int] = {}
    for event in events:
        if event.get("cat") == "cpu_op":
            counts[event.get("tid")] = counts.get(event.get("tid"), 0) + 1
    for event in events:
        if event.get("cat") == "cpu_op" and event.get("tid") == event.get("pid"):
            return event.get("tid")
    for tid, name in names.items():
        if name.endswith("(python)") and tid in counts:
            return tid
    return max(counts, key=counts.get) if counts else None
