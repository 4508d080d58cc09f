"""Export the aligned global timeline as Chrome-trace JSON (Perfetto UI, chrome://tracing), and per-rank
Kineto-format files that Holistic Trace Analysis can load.

Chrome trace: one process per rank, one thread per stream (phases, compute, communication, SEND, RECV, GPU
streams), flow arrows from every SEND to its RECV. Times are on the reference rank's clock (alignment applied).
"""
from __future__ import annotations

import json
import os
from typing import Optional


from dprorun.fsutil import atomic_write_bytes, atomic_write_json, make_private_dir
from dprorun.trace.model import Op, OpKind, RunTrace

THREADS = ("phases", "compute", "comm", "send", "recv")
CATEGORY = {OpKind.FW: "forward", OpKind.BW: "backward", OpKind.UPDATE: "update", OpKind.COMM: "communication",
            OpKind.QUEUE: "queueing", OpKind.IO: "io", OpKind.VIRTUAL: "virtual", OpKind.OTHER: "other"}


def _thread_of(op: Op) -> str:
    if op.stream == "phase":
        return "phases"
    if op.phase in ("send", "recv"):
        return op.phase
    if op.kind in (OpKind.COMM, OpKind.QUEUE):
        return "comm"
    if op.stream.startswith("cuda:"):
        return op.stream
    return "compute"


def chrome_trace(run: RunTrace, iterations: Optional[set] = None) -> dict:
    events: list[dict] = []
    tids: dict[tuple[int, str], int] = {}
    sends: dict[str, tuple[int, int, float]] = {}
    recvs: list[tuple[str, int, int, float]] = []
    for rank in sorted(run.ranks):
        trace = run.ranks[rank]
        events.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0,
                       "args": {"name": f"rank {rank} ({trace.host})"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
        for op in trace.ops:
            if iterations is not None and op.iteration not in iterations:
                continue
            thread = _thread_of(op)
            key = (rank, thread)
            if key not in tids:
                tids[key] = len([k for k in tids if k[0] == rank]) + 1
                events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tids[key],
                               "args": {"name": thread}})
            args = {"iteration": op.iteration, "kind": op.kind.value}
            for field_name in ("tensor", "nbytes", "peer", "chunk", "step", "txn_id", "phase", "granularity"):
                value = getattr(op, field_name)
                if value not in ("", -1, 0):
                    args[field_name] = value
            if op.args.get("estimated"):
                args["estimated"] = True
            events.append({"ph": "X", "name": op.name, "cat": CATEGORY[op.kind], "pid": rank, "tid": tids[key],
                           "ts": round(op.start_us, 3), "dur": round(max(op.end_us - op.start_us, 0.0), 3),
                           "args": args})
            if op.phase == "send" and op.txn_id:
                sends[op.txn_id] = (rank, tids[key], op.start_us)
            elif op.phase == "recv" and op.txn_id:
                recvs.append((op.txn_id, rank, tids[key], op.end_us))
    for flow_id, (txn, rank, tid, end) in enumerate(recvs, start=1):
        if txn not in sends:
            continue
        s_rank, s_tid, s_start = sends[txn]
        events.append({"ph": "s", "id": flow_id, "name": "transfer", "cat": "p2p", "pid": s_rank, "tid": s_tid,
                       "ts": round(s_start, 3)})
        events.append({"ph": "f", "bp": "e", "id": flow_id, "name": "transfer", "cat": "p2p", "pid": rank,
                       "tid": tid, "ts": round(end, 3)})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"job_id": run.manifest.get("job_id"), "aligned": True,
                          "clock_offsets_us": {str(r): run.ranks[r].clock_offset_us for r in sorted(run.ranks)}}}


def write_timeline(run: RunTrace, path: str) -> dict:
    doc = chrome_trace(run)
    atomic_write_json(path, doc)
    return {"path": path, "events": len(doc["traceEvents"])}


def write_hta_dir(run: RunTrace, directory: str) -> list[str]:
    """Per-rank files in the Kineto trace format (traceEvents + distributedInfo), aligned, for HTA."""
    make_private_dir(directory)
    written = []
    world = run.world_size
    for rank in sorted(run.ranks):
        trace = run.ranks[rank]
        events = []
        thread_ids: dict[str, int] = {"phases": 1}
        for n, op in enumerate(sorted(trace.ops, key=lambda o: o.start_us)):
            if op.kind is OpKind.VIRTUAL:
                continue
            cat = "cpu_op" if op.kind not in (OpKind.COMM, OpKind.QUEUE) else "user_annotation"
            events.append({"ph": "X", "cat": cat, "name": op.name, "pid": rank, "tid": thread_ids.setdefault(
                               _thread_of(op), len(thread_ids) + 1),
                           "ts": round(op.start_us, 3), "dur": round(max(op.end_us - op.start_us, 0.0), 3),
                           "args": {"External id": n, "iteration": op.iteration}})
        for iteration, start, end in trace.iterations:
            if iteration in trace.profiled_iterations:
                events.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{iteration}",
                               "pid": rank, "tid": 1, "ts": round(start, 3), "dur": round(end - start, 3),
                               "args": {"External id": -1 - iteration}})
        doc = {"schemaVersion": 1, "distributedInfo": {"backend": "gloo", "rank": rank, "world_size": world},
               "traceEvents": events, "displayTimeUnit": "ms"}
        path = os.path.join(directory, f"rank{rank}.aligned.pt.trace.json")
        # spaced separators: HTA finds a file's rank with the pattern '"rank":\s+N'
        atomic_write_bytes(path, json.dumps(doc).encode())
        written.append(path)
    return written


def ps_chrome_trace(run_dir: str) -> dict:
    """A parameter-server run (--backend mxnet) as one timeline: per worker its profiled operators (compute) and
    its push/pull of each key (kvstore), per server its updates; flow arrows per key and iteration from the
    worker's push to the server's update and from the update to the worker's pull. One host: one clock, nothing
    to align."""
    from dprorun.layout import MX_PROFILE_FILE, rank_dir
    from dprorun.trace.mxprofile import attribute_keys, numbered_files, read_mx_profile, read_server_updates

    updates, servers = read_server_updates(run_dir)
    workers = {r: read_mx_profile(path) for r, path in numbered_files(run_dir, rank_dir, MX_PROFILE_FILE).items()}
    if not workers:
        raise FileNotFoundError(f"{run_dir}: no worker profile ({MX_PROFILE_FILE})")
    lo = min(op.start_us for ops in workers.values() for op in ops)
    hi = max(op.end_us for ops in workers.values() for op in ops)
    updates = [u for u in updates if lo <= u.start_us <= hi]
    events: list[dict] = []
    for r in workers:
        events += [{"ph": "M", "name": "process_name", "pid": r, "args": {"name": f"worker {r}"}},
                   {"ph": "M", "name": "thread_name", "pid": r, "tid": 0, "args": {"name": "compute"}},
                   {"ph": "M", "name": "thread_name", "pid": r, "tid": 1, "args": {"name": "kvstore"}}]
    for s in range(servers):
        pid = 1000 + s
        events += [{"ph": "M", "name": "process_name", "pid": pid, "args": {"name": f"server {s}"}},
                   {"ph": "M", "name": "thread_name", "pid": pid, "tid": 0, "args": {"name": "update"}}]
    for u in updates:
        events.append({"ph": "X", "name": f"update k{u.key}", "cat": "update", "pid": 1000 + u.server, "tid": 0,
                       "ts": u.start_us - lo, "dur": u.end_us - u.start_us, "args": {"key": u.key, "bytes": u.nbytes}})
    flow = 0
    keyed_events = 0
    for r, ops in workers.items():
        comm = [op for op in ops if op.is_kvstore]
        for op in ops:
            if not op.is_kvstore and op.name != "DeleteVariable":
                events.append({"ph": "X", "name": op.name, "cat": "compute", "pid": r, "tid": 0,
                               "ts": op.start_us - lo, "dur": op.duration_us})
        attributed = {id(event): (key, parts) for event, key, parts in attribute_keys(comm, ops, updates)}
        keyed_events += len(attributed)
        for op in comm:
            key, parts = attributed.get(id(op), (None, []))
            name = f"pushpull k{key}" if key is not None else "pushpull (key not found)"
            events.append({"ph": "X", "name": name, "cat": "kvstore", "pid": r, "tid": 1, "ts": op.start_us - lo,
                           "dur": op.duration_us, "args": {"key": key, "servers": [p.server for p in parts]}})
            for part in parts:
                for ph, pid, tid, ts, label in (("s", r, 1, op.start_us, "push"), ("f", 1000 + part.server, 0,
                                                part.start_us, "push"), ("s", 1000 + part.server, 0, part.end_us,
                                                "pull"), ("f", r, 1, op.end_us, "pull")):
                    events.append({"ph": ph, "id": flow + (0 if label == "push" else 1), "name": f"{label} k{key}",
                                   "cat": "ps", "pid": pid, "tid": tid, "ts": ts - lo,
                                   **({"bp": "e"} if ph == "f" else {})})
                flow += 2
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "metadata": {"dprorun": "parameter-server timeline", "workers": len(workers), "servers": servers,
                         "keyed_pushpulls": keyed_events, "origin_epoch_us": lo}}
