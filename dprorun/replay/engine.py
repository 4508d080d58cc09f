"""dPRO's replay algorithm (a modified Kahn's algorithm) over an array-based graph.

Every op has a duration and a device (a rank's compute stream, a communication link, ...; -1 for virtual ops
that take no device). An op becomes ready when all its predecessors have finished; it then waits in its
device's queue. The simulation repeatedly advances the device whose next op can start earliest, runs that op
(start = max(ready time, device time)), and releases its successors. A device may have several slots, and may
belong to a pool (another device, e.g. a host's cores) one of whose slots its ops also hold while they run. Ops on
one device run in the order they became ready (to the nanosecond: times equal but for float rounding tie, and
the op built first goes first). The iteration time is the latest end. Every op remembers what decided its start
(its last finishing predecessor, or the op before it on a busy device), which yields the critical path by walking back
from the last op: the execution graph is the DFG plus those same-device ordering edges.

The core loop runs in pure Python until a process has taken PYTHON_STEPS_BEFORE_NUMBA queue steps, then
numba-compiled (about 1 µs an op) where numba is importable.
"""
from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np


@dataclass
class ReplayGraph:
    names: list[str]
    kinds: np.ndarray  # int8 codes, see KIND_NAMES
    ranks: np.ndarray  # int32
    devices: np.ndarray  # int32, -1 = no device (virtual)
    durations: np.ndarray  # float64, µs
    indptr: np.ndarray  # successors in CSR form
    indices: np.ndarray
    device_names: list[str]
    device_capacity: np.ndarray = None  # parallel slots per device (gloo runs 2 collectives at once)
    meta: dict = field(default_factory=dict)
    # what the compute passes (replay/passes.py) read: each node's compute phase (a PHASES code; 0: none or
    # mixed) and, for nodes made of profiled ops, those ops with their shares of the node's duration
    phases: np.ndarray = None  # int8
    parts: dict[int, tuple] = field(default_factory=dict)  # node -> ((ProfiledOp, share), ...)
    # per device, the device whose slots its ops also hold while they run (-1: none): a host's cores shared by the
    # devices of the processes on it (a pool device runs no op of its own)
    device_pool: np.ndarray = None  # int32

    def __post_init__(self) -> None:
        if self.device_capacity is None:
            self.device_capacity = np.ones(len(self.device_names), dtype=np.int32)
        if self.device_pool is None:
            self.device_pool = np.full(len(self.device_names), -1, dtype=np.int32)
        if self.phases is None:
            self.phases = np.zeros(len(self.durations), dtype=np.int8)

    @property
    def size(self) -> int:
        return len(self.durations)

    def stats(self) -> dict:
        """Nodes by kind, edges, devices, ranks built, and the compute ops per rank (median)."""
        kinds = np.bincount(self.kinds, minlength=len(KIND_NAMES)) if self.size else np.zeros(len(KIND_NAMES))
        compute = np.isin(self.kinds, [KIND_CODE[k] for k in ("FW", "BW", "UPDATE", "IO", "OTHER")])
        compute &= self.ranks >= 0  # ops of no rank (a parameter server's: rank -1 - server) are not a rank's
        per_rank = np.bincount(self.ranks[compute]) if compute.any() else np.zeros(1)
        return {"nodes": int(self.size), "edges": int(len(self.indices)),
                "kinds": {KIND_NAMES[k]: int(n) for k, n in enumerate(kinds) if n},
                "devices": len(self.device_names), "ranks_built": int(self.meta.get("ranks_built", 0)),
                "compute_ops_per_rank": float(np.median(per_rank[per_rank > 0])) if (per_rank > 0).any() else 0.0}


KIND_NAMES = ("FW", "BW", "COMM", "QUEUE", "UPDATE", "IO", "VIRTUAL", "OTHER")
KIND_CODE = {k: i for i, k in enumerate(KIND_NAMES)}
# a compute node's phase: what the compute passes scale ("backward" is backward compute; DDP's per-bucket
# enqueue cost and re-computed forward are phases of their own)
PHASES = ("", "forward", "loss", "backward", "recompute", "enqueue", "finalize", "update", "tail", "accumulate")
PHASE_CODE = {p: i for i, p in enumerate(PHASES)}


class GraphBuilder:
    """Incremental construction of a ReplayGraph (edges collected as pairs, converted to CSR once)."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.kinds: list[int] = []
        self.ranks: list[int] = []
        self.devices: list[int] = []
        self.durations: list[float] = []
        self.src: list[int] = []
        self.dst: list[int] = []
        self.device_index: dict[str, int] = {}
        self.capacity: dict[str, int] = {}
        self.pool: dict[str, str] = {}  # device -> the pool device its ops also hold
        self.phases: list[int] = []
        self.parts: dict[int, tuple] = {}

    @classmethod
    def prefix_of(cls, graph: ReplayGraph, nodes: int) -> "GraphBuilder":
        """A builder holding the graph's first `nodes` nodes and the edges among them, as they were built (same
        ids, devices registered in the same order, edges in the same order), to append to."""
        g = cls()
        g.names = list(graph.names[:nodes])
        g.kinds = graph.kinds[:nodes].tolist()
        g.ranks = graph.ranks[:nodes].tolist()
        g.durations = graph.durations[:nodes].tolist()
        g.phases = graph.phases[:nodes].tolist()
        g.parts = {k: v for k, v in graph.parts.items() if k < nodes}
        devices = graph.devices[:nodes]
        used = np.unique(devices[devices >= 0])
        remap = np.full(len(graph.device_names) + 1, -1, dtype=np.int64)  # index -1 (no device) stays -1
        remap[used] = np.arange(len(used))
        for new, old in enumerate(used.tolist()):
            g.device_index[graph.device_names[old]] = new
            g.capacity[graph.device_names[old]] = int(graph.device_capacity[old])
        for old in used.tolist():  # the pools after the devices (registered after them, ids kept)
            pool = int(graph.device_pool[old])
            if pool >= 0:
                g.share(graph.device_names[old], graph.device_names[pool], int(graph.device_capacity[pool]))
        g.devices = remap[devices].tolist()
        src = np.repeat(np.arange(nodes), np.diff(graph.indptr[:nodes + 1]))
        dst = graph.indices[:graph.indptr[nodes]]
        inside = dst < nodes
        g.src, g.dst = src[inside].tolist(), dst[inside].tolist()
        return g

    @property
    def size(self) -> int:
        return len(self.names)

    def device(self, name: Optional[str], capacity: int = 1) -> int:
        if name is None:
            return -1
        if name not in self.device_index:
            self.device_index[name] = len(self.device_index)
            self.capacity[name] = max(1, capacity)
        return self.device_index[name]

    def share(self, device: str, pool: str, capacity: int) -> None:
        """Ops on `device` (registered by its first op, with its own capacity) also hold one of `pool`'s `capacity`
        slots while they run (a host's cores)."""
        self.device(pool, capacity)
        self.pool[device] = pool

    def op(self, name: str, kind: str, rank: int, device: Optional[str], duration_us: float,
           capacity: int = 1, phase: str = "", parts: tuple = ()) -> int:
        self.names.append(name)
        self.kinds.append(KIND_CODE[kind])
        self.ranks.append(rank)
        self.devices.append(self.device(device, capacity))
        self.durations.append(max(0.0, float(duration_us)))
        self.phases.append(PHASE_CODE[phase])
        if parts:
            self.parts[len(self.names) - 1] = parts
        return len(self.names) - 1

    def edge(self, u: int, v: int) -> None:
        self.src.append(u)
        self.dst.append(v)

    def chain(self, ids: list[int]) -> None:
        for a, b in zip(ids, ids[1:]):
            self.edge(a, b)

    def build(self, meta: Optional[dict] = None) -> ReplayGraph:
        n = len(self.names)
        src = np.asarray(self.src, dtype=np.int64)
        dst = np.asarray(self.dst, dtype=np.int64)
        order = np.argsort(src, kind="stable")
        indices = dst[order].astype(np.int32)
        counts = np.bincount(src, minlength=n) if n else np.zeros(0, dtype=np.int64)
        indptr = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(counts, out=indptr[1:])
        devices = sorted(self.device_index, key=self.device_index.get)
        pools = np.asarray([self.device_index[self.pool[d]] if d in self.pool else -1 for d in devices],
                           dtype=np.int32)
        return ReplayGraph(self.names, np.asarray(self.kinds, dtype=np.int8), np.asarray(self.ranks, dtype=np.int32),
                           np.asarray(self.devices, dtype=np.int32), np.asarray(self.durations, dtype=np.float64),
                           indptr, indices, devices, np.asarray([self.capacity[d] for d in devices], dtype=np.int32),
                           dict(meta or {}), np.asarray(self.phases, dtype=np.int8), self.parts, pools)


def copy_ranks(graph: ReplayGraph, local_nodes: int, period: int, built: int, name_prefix: Callable[[int], str],
               device_prefix: Callable[[int], str]) -> tuple[GraphBuilder, list[np.ndarray]]:
    """The world-size copy of local DFGs: built rank b gets a copy of rank b % period's nodes among the graph's
    first `local_nodes` (names and devices renumbered: `name_prefix(s)` -> `name_prefix(b)` at the start of a name,
    `device_prefix(s)` -> `device_prefix(b)` once in a device's name), with the edges among them. Returns the
    builder and, per built rank, the map from the graph's node ids to the copy's (-1: not copied there)."""
    ranks = graph.ranks[:local_nodes]
    if ((ranks < 0) | (ranks >= period)).any():
        raise ValueError("the local DFGs hold nodes of no built rank: the world-size pass cannot copy them")
    src = np.repeat(np.arange(local_nodes), np.diff(graph.indptr[:local_nodes + 1]))
    dst = graph.indices[:graph.indptr[local_nodes]]
    inside = dst < local_nodes
    src, dst = src[inside], dst[inside]
    g = GraphBuilder()
    mappings = []
    for b in range(built):
        s = b % period
        nodes = np.flatnonzero(ranks == s)
        mapping = np.full(local_nodes, -1, dtype=np.int64)
        mapping[nodes] = g.size + np.arange(len(nodes))
        old, new = name_prefix(s), name_prefix(b)
        g.names += [new + name[len(old):] if name.startswith(old) else name
                    for name in (graph.names[n] for n in nodes.tolist())]
        g.kinds += graph.kinds[nodes].tolist()
        g.ranks += [b] * len(nodes)
        g.durations += graph.durations[nodes].tolist()
        g.phases += graph.phases[nodes].tolist()
        device_ids = {-1: -1}
        for d in np.unique(graph.devices[nodes]).tolist():
            if d >= 0:
                name = graph.device_names[d].replace(device_prefix(s), device_prefix(b), 1)
                device_ids[d] = g.device(name, int(graph.device_capacity[d]))
                if graph.device_pool[d] >= 0:
                    pool = int(graph.device_pool[d])
                    g.share(name, graph.device_names[pool], int(graph.device_capacity[pool]))
        g.devices += [device_ids[d] for d in graph.devices[nodes].tolist()]
        g.parts.update({int(mapping[n]): graph.parts[n] for n in nodes.tolist() if n in graph.parts})
        edges = ranks[src] == s
        g.src += mapping[src[edges]].tolist()
        g.dst += mapping[dst[edges]].tolist()
        mappings.append(mapping)
    return g, mappings


def _tick(t):
    """An op's place in the ready queue: its ready time to the nanosecond, so that times equal but for float
    rounding (a chain's ops summed one by one, or merged into one by coarsening) tie, and the op built first goes
    first in both."""
    return np.floor(t * 1000.0 + 0.5) / 1000.0


def _earliest_slot(d, offset, slot_time):
    slot = offset[d]
    for k in range(offset[d] + 1, offset[d + 1]):
        if slot_time[k] < slot_time[slot]:
            slot = k
    return slot


def _simulate(durations, devices, indptr, indices, capacity, pool, max_steps):
    """(start, end, crit, ops done, queue steps taken); ops done = -1 where it stopped at max_steps."""
    n = durations.shape[0]
    n_devices = capacity.shape[0]
    indeg = np.zeros(n, dtype=np.int64)
    for e in range(indices.shape[0]):
        indeg[indices[e]] += 1
    # each device has capacity[d] slots: slot_time / slot_last hold when a slot frees up and what ran there
    offset = np.zeros(n_devices + 1, dtype=np.int64)
    for d in range(n_devices):
        offset[d + 1] = offset[d] + capacity[d]
    slot_time = np.zeros(max(offset[n_devices], 1), dtype=np.float64)
    slot_last = np.full(max(offset[n_devices], 1), -1, dtype=np.int64)
    ready = np.zeros(n, dtype=np.float64)
    start = np.zeros(n, dtype=np.float64)
    end = np.zeros(n, dtype=np.float64)
    crit = np.full(n, -1, dtype=np.int64)
    dep = np.full(n, -1, dtype=np.int64)
    heap = [(0.0, np.int64(0))]
    heap.pop()
    for i in range(n):
        if indeg[i] == 0:
            heapq.heappush(heap, (0.0, np.int64(i)))
    done = 0
    steps = 0
    while len(heap) > 0:
        steps += 1
        if steps > max_steps:
            return start, end, crit, -1, steps - 1
        key, u = heapq.heappop(heap)
        d = devices[u]
        begin = ready[u]
        slot = -1
        shared = -1  # the slot of the device's pool (a host's cores) the op also holds
        waited = dep[u]
        if d >= 0:
            slot = offset[d]  # the earliest free slot (inline: the hot path)
            for k in range(offset[d] + 1, offset[d + 1]):
                if slot_time[k] < slot_time[slot]:
                    slot = k
            if slot_time[slot] > begin:
                begin = slot_time[slot]
                waited = slot_last[slot]
            if pool[d] >= 0:
                shared = _earliest_slot(pool[d], offset, slot_time)
                if slot_time[shared] > begin:
                    begin = slot_time[shared]
                    waited = slot_last[shared]
        if begin > ready[u] and _tick(begin) > key:  # every slot got busy since this op was queued: wait
            heapq.heappush(heap, (_tick(begin), u))
            continue
        crit[u] = waited
        start[u] = begin
        finish = begin + durations[u]
        end[u] = finish
        if slot >= 0:
            slot_time[slot] = finish
            slot_last[slot] = u
        if shared >= 0:
            slot_time[shared] = finish
            slot_last[shared] = u
        done += 1
        for e in range(indptr[u], indptr[u + 1]):
            v = np.int64(indices[e])
            if finish >= ready[v]:
                ready[v] = finish
                dep[v] = u
            indeg[v] -= 1
            if indeg[v] == 0:
                heapq.heappush(heap, (_tick(ready[v]), v))
    return start, end, crit, done, steps


PYTHON_STEPS_BEFORE_NUMBA = 100_000  # queue steps a process replays in pure Python before it loads numba's loop
UNBOUNDED = 1 << 62


@dataclass
class _EngineCache:
    """The numba-compiled loop, loaded once per process when first worth it, and the queue steps (an op taken
    from the ready queue, run or put back to wait for its device) replayed in Python before. Loading numba and
    its cached compilation takes about 1.4 s; the Python loop about 4-8 µs a step: a small job's checks (a
    thousand ops, a few replays) end in Python long before numba would have loaded; a search replaying large
    graphs, or a graph whose ops queue long on one device, loads it (the replay that crosses the budget is
    stopped and run again compiled). Both loops give the same times."""
    python_steps: int = 0
    loaded: bool = False
    fast: Optional[Callable] = None

    def simulate(self, arrays: tuple, use_fast: bool) -> tuple:
        """(start, end, crit, done, engine) of _simulate over the graph's arrays."""
        if not use_fast:
            return *_simulate(*arrays, UNBOUNDED)[:4], "python"
        if not self.loaded:
            budget = PYTHON_STEPS_BEFORE_NUMBA - self.python_steps
            start, end, crit, done, steps = _simulate(*arrays, max(budget, 0))
            self.python_steps += steps
            if done >= 0:
                return start, end, crit, done, "python"
            self.loaded, self.fast = True, _compile_numba()
        if self.fast is None:
            return *_simulate(*arrays, UNBOUNDED)[:4], "python"
        return *self.fast(*arrays, UNBOUNDED)[:4], "numba"


def load_compiled() -> str:
    """The numba-compiled loop loaded now, whatever Python has replayed so far (a benchmark timing the loop); the
    engine replays then use."""
    if not _ENGINE.loaded:
        _ENGINE.loaded, _ENGINE.fast = True, _compile_numba()
    return "numba" if _ENGINE.fast is not None else "python"


def _compile_numba() -> Optional[Callable]:
    """The loop and its helpers numba-compiled (from numba's on-disk cache after the first time); None without
    numba. The helpers are replaced in this module, where the compiled loop finds them."""
    global _tick, _earliest_slot
    try:
        import numba
    except ImportError:  # pragma: no cover
        return None
    _tick = numba.njit(cache=True)(_tick)
    _earliest_slot = numba.njit(cache=True)(_earliest_slot)
    return numba.njit(cache=True)(_simulate)


_ENGINE = _EngineCache()


@dataclass
class ReplayResult:
    iteration_time_us: float
    start_us: np.ndarray
    end_us: np.ndarray
    critical_path: list[int]
    device_busy_us: dict[str, float]
    replay_time_s: float
    engine: str

    def device_utilisation(self) -> dict[str, float]:
        total = self.iteration_time_us or 1.0
        return {name: busy / total for name, busy in self.device_busy_us.items()}


def replay(graph: ReplayGraph, use_fast: bool = True) -> ReplayResult:
    """The graph replayed (see the module's docstring); use_fast=False: always the pure-Python loop."""
    started = time.perf_counter()
    start, end, crit, done, engine = _ENGINE.simulate(
        (graph.durations, graph.devices, graph.indptr, graph.indices, graph.device_capacity.astype(np.int64),
         graph.device_pool.astype(np.int64)), use_fast)
    if done != graph.size:
        raise ValueError(f"the graph has a cycle: only {done} of {graph.size} ops could run")
    last = int(np.argmax(end)) if graph.size else -1
    path = []
    node = last
    while node >= 0:
        path.append(node)
        node = int(crit[node])
    path.reverse()
    busy = np.bincount(graph.devices[graph.devices >= 0], weights=graph.durations[graph.devices >= 0],
                       minlength=len(graph.device_names)) if graph.size else np.zeros(0)
    pooled = graph.device_pool >= 0
    if pooled.any():  # a pool (a host's cores) is busy with the ops of its member devices
        busy = busy + np.bincount(graph.device_pool[pooled], weights=busy[pooled], minlength=len(busy))
    busy = busy / np.maximum(graph.device_capacity, 1)
    elapsed = time.perf_counter() - started
    return ReplayResult(float(end.max()) if graph.size else 0.0, start, end, path,
                        {name: float(busy[i]) for i, name in enumerate(graph.device_names)}, elapsed, engine)


def critical_path_report(graph: ReplayGraph, result: ReplayResult, top: int = 20) -> dict:
    """The critical path as a ranked list plus its split into compute, communication and queueing."""
    rows = []
    share = {"compute": 0.0, "communication": 0.0, "queueing": 0.0, "virtual": 0.0}
    previous_end = 0.0
    for node in result.critical_path:
        kind = KIND_NAMES[graph.kinds[node]]
        duration = float(result.end_us[node] - result.start_us[node])
        wait = max(0.0, float(result.start_us[node]) - previous_end)
        previous_end = float(result.end_us[node])
        bucket = "communication" if kind == "COMM" else "queueing" if kind == "QUEUE" else \
            "virtual" if kind == "VIRTUAL" else "compute"
        share[bucket] += duration
        share["queueing"] += wait
        rows.append({"op": graph.names[node], "rank": int(graph.ranks[node]), "kind": kind,
                     "device": graph.device_names[graph.devices[node]] if graph.devices[node] >= 0 else None,
                     "start_ms": round(float(result.start_us[node]) / 1000, 4), "time_on_path_ms": round(duration / 1000, 4)})
    total = sum(share.values()) or 1.0
    ranked = sorted(rows, key=lambda r: -r["time_on_path_ms"])[:top]
    return {"length": len(rows), "share_pct": {k: round(100 * v / total, 2) for k, v in share.items()},
            "top": ranked, "path": rows}


def execution_graph(graph: ReplayGraph, result: ReplayResult) -> dict:
    """The execution graph of a replay: every op as it ran (device, start, end, on the critical path or not) and
    its edges, the DFG's ("dfg") plus the same-device ordering the replay imposed ("device": each op after the
    one that ran before it on the same slot of its device; a device with k slots is split back into k lanes,
    each op on the lane that freed up last before it started)."""
    on_path = set(result.critical_path)
    ops = []
    for i in range(graph.size):
        d = int(graph.devices[i])
        ops.append({"id": i, "name": graph.names[i], "rank": int(graph.ranks[i]), "kind": KIND_NAMES[graph.kinds[i]],
                    "device": graph.device_names[d] if d >= 0 else None,
                    "start_us": round(float(result.start_us[i]), 3), "end_us": round(float(result.end_us[i]), 3),
                    "critical": i in on_path})
    edges = [[int(u), int(graph.indices[e]), "dfg"] for u in range(graph.size)
             for e in range(graph.indptr[u], graph.indptr[u + 1])]
    placed = graph.devices >= 0
    for d in range(len(graph.device_names)):
        members = np.flatnonzero(placed & (graph.devices == d))
        order = members[np.lexsort((result.end_us[members], result.start_us[members]))]
        lanes: list[tuple[float, int]] = []  # (free from, last op) per slot
        for op in order:
            start = float(result.start_us[op])
            free = [k for k, (until, _) in enumerate(lanes) if until <= start + 1e-6]
            if free:
                k = max(free, key=lambda j: lanes[j][0])
                edges.append([int(lanes[k][1]), int(op), "device"])
                lanes[k] = (float(result.end_us[op]), int(op))
            else:
                lanes.append((float(result.end_us[op]), int(op)))
    return {"iteration_time_us": result.iteration_time_us, "ops": ops, "edges": edges,
            "critical_path": [int(i) for i in result.critical_path]}


def replay_chrome_trace(graph: ReplayGraph, result: ReplayResult) -> dict:
    """The replayed iteration as a Chrome trace (chrome://tracing, Perfetto): a process per rank, a thread per
    device (a device with several slots gets one thread per slot), ops on the critical path marked in args."""
    on_path = set(result.critical_path)
    events, threads = [], {}
    lanes: dict[int, list[float]] = {}
    for op in np.lexsort((result.end_us, result.start_us)):
        d = int(graph.devices[op])
        rank = int(graph.ranks[op])
        if d < 0:
            continue
        busy = lanes.setdefault(d, [])
        start = float(result.start_us[op])
        slot = next((k for k, until in enumerate(busy) if until <= start + 1e-6), len(busy))
        if slot == len(busy):
            busy.append(0.0)
        busy[slot] = float(result.end_us[op])
        name = graph.device_names[d] + (f" [{slot}]" if graph.device_capacity[d] > 1 else "")
        tid = threads.setdefault((rank, name), len(threads) + 1)
        events.append({"name": graph.names[op], "cat": KIND_NAMES[graph.kinds[op]], "ph": "X", "pid": rank,
                       "tid": tid, "ts": start, "dur": float(result.end_us[op]) - start,
                       "args": {"critical_path": int(op) in on_path}})
    for (rank, name), tid in threads.items():
        events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": name}})
    for rank in sorted({r for r, _ in threads}):
        events.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
                       "args": {"name": f"rank {rank} (replayed)"}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}
