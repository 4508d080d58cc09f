"""Reader of MXNet's profiler dump (`mx.profiler.dump()`: Chrome trace JSON, epoch-µs timestamps).

Every operator appears twice: as a B/E pair on its device's process (pid 0 = cpu/0, the compute device; 2 = cpu
pinned, where the kvstore's push/pull ops run) and as b/e on an "operator" process; the B/E pairs are read. A push
or pull event carries neither its key nor its bytes: the hooks record those from the kvstore calls
(runtime/mxnet.py) and the model pairs them by count and order (replay/ps.py).
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

import numpy as np

from dprorun.fsutil import TraceError
from dprorun.layout import node_offset_us

KVSTORE_PREFIX = "KVStoreDist"  # KVStoreDistDefaultStoragePushPull, ...Push, ...Pull
COPY_OP = "CopyCPU2CPU"
NOT_COMPUTE = ("DeleteVariable", "WaitForVar", "WaitForAll")  # engine bookkeeping and the script's own waits
# a worker with several contexts (ctx=[gpu(0), gpu(1)], or cpu(i)) sums each key's gradients from its contexts
# before the push: compute on the push's path, not the start of an iteration
LOCAL_REDUCE_OP = "KVStoreReduce"
# an array filled with a value (`x[:] = 0`): the backward zeroes the buffers it accumulates gradients into with it (a
# residual net's shared inputs), between the pushes of one iteration's keys; not a sign of the next forward
FILL_OP = "SetValueOp"
# an optimizer's update on the worker (sgd_update, sgd_mom_update, adam_update, multi_sgd_update, lamb_update_phase1,
# ...): it runs as soon as its key's pull is in, between the pulls of the iteration's other keys
UPDATE_OP = re.compile(r"(^|_)update(_phase\d)?$")


@dataclass(slots=True)
class MXOp:
    name: str
    device: str  # the profiler's process name: "cpu/0", "cpu pinned/", ...
    start_us: float
    end_us: float

    @property
    def duration_us(self) -> float:
        return self.end_us - self.start_us

    @property
    def is_kvstore(self) -> bool:
        return self.name.startswith(KVSTORE_PREFIX)


def read_mx_profile(path: str) -> list[MXOp]:
    """The operators of one dump, sorted by start (an unfinished dump: up to its last complete event). A foreign
    file, or one cut inside its first event, raises TraceError naming it."""
    return read_mx_profile_checked(path)[0]


def read_mx_profile_checked(path: str) -> tuple[list[MXOp], bool]:
    """read_mx_profile, and whether the dump was unfinished (read to its last complete event)."""
    try:
        with open(path) as handle:
            text = handle.read()
    except OSError as exc:
        raise TraceError(path, f"not a readable mx.profiler dump ({type(exc).__name__}: {exc})") from None
    unfinished = False
    if text.lstrip().startswith(","):  # a dump after the script's own finished one: MXNet writes no header then
        text = '{"traceEvents": [' + text.lstrip()[1:]
    try:
        doc = json.loads(text)
    except ValueError as exc:
        doc, unfinished = _unfinished_dump(text), True
        if doc is None:
            raise TraceError(path, f"not a readable mx.profiler dump ({type(exc).__name__}: {exc})") from None
    events = doc.get("traceEvents") if isinstance(doc, dict) else None
    if not isinstance(events, list):
        raise TraceError(path, "no traceEvents (not an mx.profiler dump)")
    devices = {e.get("pid"): str(e.get("args", {}).get("name", "")) for e in events
               if e.get("ph") == "M" and e.get("name") == "process_name"}
    open_ops: dict[tuple, list[float]] = {}
    ops: list[MXOp] = []
    for event in events:
        phase = event.get("ph")
        if phase not in ("B", "E") or event.get("cat") != "operator":
            continue
        key = (event.get("pid"), event.get("tid"), event.get("name"))
        if phase == "B":
            open_ops.setdefault(key, []).append(float(event["ts"]))
        elif open_ops.get(key):
            start = open_ops[key].pop()
            ops.append(MXOp(str(event["name"]), devices.get(event.get("pid"), str(event.get("pid"))), start,
                            float(event["ts"])))
    shift = node_offset_us(os.path.dirname(os.path.abspath(path)))  # another host's folder: node 0's clock
    if shift:
        ops = [MXOp(op.name, op.device, op.start_us + shift, op.end_us + shift) for op in ops]
    ops.sort(key=lambda op: op.start_us)
    return ops, unfinished


def _unfinished_dump(text: str):
    """An mx.profiler dump its process never finished (`dump(finished=False)` leaves the event list open until the
    process ends normally; a worker killed, or one that left at once after its script raised, never closes it):
    its complete events, or None when it is not such a file."""
    if not text.lstrip().startswith("{") or '"traceEvents"' not in text[:200]:
        return None
    end = text.rfind("}")
    for _ in range(64):  # the last complete event ends at one of the last few braces (cut inside an event's args)
        if end <= 0:
            break
        try:
            return json.loads(text[:end + 1] + "\n]}")
        except ValueError:
            end = text.rfind("}", 0, end)
    return None


@dataclass(slots=True)
class ServerUpdate:
    server: int
    key: int
    start_us: float
    end_us: float
    nbytes: int


def comm_phases(comm: list[MXOp], compute: list[MXOp]) -> list[list[MXOp]]:
    """The push/pull events grouped per iteration: runs whose spans overlap, joined across a gap unless a forward
    op (`starts_an_iteration`) of the worker's `compute` starts inside it. The next iteration's forward (its loss
    ops at least, or a hybridized net's whole graph) waits for the pulls of every key it reads, so it separates two
    iterations; a gap with no forward in it is the script dispatching its next key late (a key whose push/pull
    ended before the next one started: a loaded host, the other workers already waiting) or an imperative
    backward making the next gradient. Push/pull as one op or as separate push and pull ops alike."""
    import bisect

    forward = sorted(op.start_us for op in compute if starts_an_iteration(op))
    groups: list[list[MXOp]] = []
    end = None
    for op in sorted(comm, key=lambda o: o.start_us):
        if end is None or (op.start_us > end and bisect.bisect_right(forward, op.start_us)
                           > bisect.bisect_left(forward, end)):
            groups.append([])
            end = op.end_us
        groups[-1].append(op)
        end = max(end, op.end_us)
    return groups


def starts_an_iteration(op: MXOp) -> bool:
    """A forward (or loss) op: not push/pull, not a pulled value's copy, not engine bookkeeping, not backward, not
    the sum of a key's gradients from the worker's contexts, not an array filled with a value, not an optimizer's
    update of a pulled key on the worker."""
    return not (op.is_kvstore or op.name in (COPY_OP, LOCAL_REDUCE_OP, FILL_OP) or op.name in NOT_COMPUTE
                or op.name.startswith("_backward") or UPDATE_OP.search(op.name) is not None)


def attribute_keys(events: list[MXOp], compute: list[MXOp],
                   updates: list[ServerUpdate]) -> list[tuple[MXOp, int, list[ServerUpdate]]]:
    """A worker's push/pull events with the key each carried, found through the servers' updates (which name
    their key): the update of key k for an iteration falls inside that iteration's push/pull of k on every worker
    (push -> aggregation and update -> pull). Per iteration (`comm_phases`, split by the worker's forward ops among
    `compute`) each key goes to one event and each event to one key, an assignment (scipy's linear_sum_assignment)
    that prefers the event holding the key's updates from the most servers (a key split over servers has one update
    per server inside its event), then the one that ends soonest after them (the pull follows the update). Events
    no key fits are left out."""
    from scipy.optimize import linear_sum_assignment

    out = []
    for group in comm_phases(events, compute):
        lo, hi = min(e.start_us for e in group), max(e.end_us for e in group)
        inside = [u for u in updates if lo <= u.start_us and u.end_us <= hi]
        keys = sorted({u.key for u in inside})
        if not keys:
            continue
        cost = np.full((len(group), len(keys)), np.inf)
        held: dict[tuple[int, int], list[ServerUpdate]] = {}
        for i, event in enumerate(group):
            for j, key in enumerate(keys):
                ups = [u for u in inside if u.key == key and event.start_us <= u.start_us and u.end_us <= event.end_us]
                if ups:
                    latest = {}
                    for u in ups:
                        if u.server not in latest or u.end_us > latest[u.server].end_us:
                            latest[u.server] = u
                    held[(i, j)] = sorted(latest.values(), key=lambda u: u.server)
                    cost[i, j] = -1e9 * len(latest) + (event.end_us - max(u.end_us for u in ups))
        finite = np.where(np.isfinite(cost), cost, 1e18)
        rows, cols = linear_sum_assignment(finite)
        out += [(group[i], keys[j], held[(i, j)]) for i, j in zip(rows, cols) if (i, j) in held]
    order = {id(e): k for k, e in enumerate(events)}
    return sorted(out, key=lambda item: order[id(item[0])])


def numbered_files(run_dir: str, folder, name: str) -> dict[int, str]:
    """{k: path} of `name` in folder(run_dir, 0), folder(run_dir, 1), ... up to the first that lacks it (workers'
    rank_<r>, servers' server_<s>)."""
    import os

    found = {}
    while os.path.exists(os.path.join(folder(run_dir, len(found)), name)):
        found[len(found)] = os.path.join(folder(run_dir, len(found)), name)
    return found


def read_server_docs(run_dir: str) -> dict[int, dict]:
    """Every server's server_<s>/server.json, as read (an unreadable one raises TraceError, naming it)."""
    from dprorun.fsutil import read_json
    from dprorun.layout import SERVER_FILE, server_dir

    return {s: read_json(path) for s, path in numbered_files(run_dir, server_dir, SERVER_FILE).items()}


def read_server_updates(run_dir: str, docs: dict[int, dict] | None = None) -> tuple[list[ServerUpdate], int]:
    """Every server's timed updates (server_<s>/server.json, or `docs` as read_server_docs read them; calibration
    keys included), and how many servers wrote them."""
    from dprorun.layout import server_dir

    docs = read_server_docs(run_dir) if docs is None else docs
    updates: list[ServerUpdate] = []
    for s, doc in docs.items():
        shift = node_offset_us(server_dir(run_dir, s))  # a server of another host: on node 0's clock
        updates += [ServerUpdate(s, int(k), float(a) + shift, float(b) + shift, int(n))
                    for k, a, b, n in doc.get("updates", [])]
    return updates, len(docs)

