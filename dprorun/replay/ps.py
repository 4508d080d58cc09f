"""Parameter-server jobs (MXNet kvstore dist_sync and dist_async) in the global DFG: the model's types, the
PS topology joining the workers' local DFGs through the servers, and its replay under what-ifs.

The graph of one iteration: the workers' local DFGs (`local_dfgs`: worker r's profiled compute ops in order, gaps
as "(between ops)", on device `w<r>` -> the push/pull dispatch latency, the In node of every key; per key the copy
of the pulled key into the parameter, MXNet's Broadcast, its Out node; the tail from the last copy to the next
iteration's first op), joined through the servers by the PS topology of replay/ps_topology.py (pushes, the
servers' updates, pulls; MXNet's key placement), whose passes answer the what-ifs.

The model's costs are measured and fitted from a run directory by replay/ps_model.py (`build_ps_model`).
What-ifs: servers, the big-array bound, workers, bandwidth, the links' layout.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional

import numpy as np

from dprorun.replay.engine import GraphBuilder, ReplayGraph, ReplayResult, replay
from dprorun.replay.ps_cpu import CPUFloor, HostCPU, busy_hosts, cpu_floor, cpu_note, spinning_note, spinning_servers
from dprorun.replay.ps_topology import LOOPBACK_GBIT, PSKey, PSLinks, PSPlan, engine_us, launcher_server_hosts, \
    placed, set_placement, set_ps_network, set_workers
from dprorun.stats import median

# a server that could not load the optimizer the workers sent (runtime/mxnet.watch_controller_errors)
OPTIMIZER_NOT_LOADED = (
    "warning: server(s) {servers} could not load the optimizer the workers sent ({error}): they ran no update, and an "
    "MXNet server without an updater stores the workers' summed gradients as the values each pull returns, so the "
    "job did not train as written (its timing is replayed as it ran). MXNet runs a server inside `import mxnet`, "
    "before the script defines anything: a class of the script's own (its optimizer, or a learning-rate scheduler "
    "the optimizer holds) never reaches the servers; give the Trainer update_on_kvstore=False to run the optimizer "
    "on the workers")


@dataclass
class WorkerOps:
    """One worker's profiled iteration (medians over its complete profiled iterations): compute ops in order."""

    rank: int
    ops: list[tuple[str, float]]  # (name, µs); gaps as "(between ops)"
    dispatch_us: float  # backward end -> the first push starts
    tail_us: float  # the last copy's end -> the next iteration's first op
    copy_us_per_byte: float
    profiled_iterations: int
    period_us: float = 0.0  # the profiled iterations' own length (first op -> the next iteration's first op)
    # where the i-th push (in start order) began: after this many nodes of `ops` (empty: every push after all of
    # them, a hybridized net's one backward op); an imperative net pushes each gradient as its backward makes it
    push_after: list[int] = field(default_factory=list)

    @property
    def compute_us(self) -> float:
        return sum(d for _, d in self.ops)


@dataclass
class PSWhatIf:
    servers: Optional[int] = None
    bigarray_bound: Optional[int] = None
    workers: Optional[int] = None
    bandwidth_scale: float = 1.0
    bandwidth_gbit: Optional[float] = None
    links: Optional[str] = None  # "shared" (one medium), "per-node" (a NIC per role), "hosts" (a NIC per host)

    def describe(self) -> str:
        parts = [f"{name} {value}" for name, value in (("servers", self.servers), ("bigarray bound",
                 self.bigarray_bound), ("workers", self.workers), ("bandwidth Gbit/s", self.bandwidth_gbit))
                 if value is not None]
        if self.bandwidth_scale != 1.0:
            parts.append(f"bandwidth x{self.bandwidth_scale:g}")
        if self.links:
            parts.append(f"{self.links} links")
        return ", ".join(parts) or "as run"


@dataclass
class PSModel:
    workers: int
    servers: int
    bigarray_bound: int
    keys: list[PSKey]
    worker_ops: dict[int, WorkerOps]
    update_us: tuple[float, float]  # server update: a + b * bytes
    alpha_us: float
    bytes_per_us: float
    compute_scale: float = 1.0
    # "shared": every role on one host, every transfer through its one loopback, which moves bytes with the host's
    # cores (link_slots transfers at once); "per-node": each worker and server its own link up and down (a NIC)
    links: str = "shared"
    # roles on several hosts ("hosts" links): the hosts' names, and each worker's and server's host (index)
    hosts: list[str] = field(default_factory=list)
    worker_hosts: list[int] = field(default_factory=list)
    server_hosts: list[int] = field(default_factory=list)
    link_slots: int = 1
    link_level: float = 1.0  # the job's own transfers against the calibration's (bandwidth factor, fitted)
    reference: str = "window"  # the iterations the compute was scaled to: "clean" or "window"
    profiled_iteration_us: Optional[float] = None  # the profile's own iterations (median over workers)
    calibration: list[tuple[int, float, int]] = field(default_factory=list)  # (bytes, µs, parts) median over workers
    window_iterations_us: list[float] = field(default_factory=list)  # unprofiled window iterations, all workers
    clean_iterations_us: list[float] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # the servers' engine, probed: copying an array into another, adding one to another ((bytes, µs) by size, the
    # median over the servers; empty: not probed)
    copy_us: tuple[tuple[float, float], ...] = ()
    add_us: tuple[tuple[float, float], ...] = ()
    # the host's cores, shared by the workers' compute, the loopback's transfers and the servers' engines (0: each
    # of them as if on a core of its own)
    host_cores: int = 0
    host_cpu: list[HostCPU] = field(default_factory=list)  # each host's busy cores over the window (replay/ps_cpu.py)
    fitted_as_run_us: Optional[float] = None  # the job as it ran, replayed with the fitted costs (its self-check)
    sync: bool = True  # the kvstore's mode: dist_sync (the workers joined at every key's update), or dist_async
    push_ratio: float = 1.0  # the bytes a push carries of its key's: 1, or its gradient compression's (2-bit 1/16)

    @property
    def measured_iteration_us(self) -> Optional[float]:
        """The run's own iteration time the compute was scaled to (median of the reference iterations)."""
        return median(self.clean_iterations_us if self.reference == "clean" else self.window_iterations_us)

    def to_json(self) -> dict:
        return {"workers": self.workers, "servers": self.servers, "bigarray_bound": self.bigarray_bound,
                "kvstore": "dist_sync" if self.sync else "dist_async", "push_ratio": self.push_ratio,
                "keys": len(self.keys), "bytes": sum(k.nbytes for k in self.keys),
                "alpha_us": round(self.alpha_us, 2), "bandwidth_gbit_s": round(self.bytes_per_us * 8e-3, 3),
                "update_us": [round(self.update_us[0], 2), round(self.update_us[1] * 1e6, 3)],
                "server_copy_us": [[int(b), round(t, 1)] for b, t in self.copy_us],
                "server_add_us": [[int(b), round(t, 1)] for b, t in self.add_us],
                "compute_scale": round(self.compute_scale, 3), "links": self.links, "link_slots": self.link_slots,
                "link_level": round(self.link_level, 3), "host_cores": self.host_cores,
                "reference": self.reference, "hosts": self.hosts,
                "worker_hosts": self.worker_hosts, "server_hosts": self.server_hosts,
                "calibration": [[b, round(t, 1), p] for b, t, p in self.calibration],
                "host_cpu": [h.to_json() for h in self.host_cpu]}


@dataclass
class PSPrediction:
    iteration_ms: float
    whatif: str
    critical_path: list[str]
    device_busy_ms: dict[str, float]
    graph_ops: int
    notes: list[str]
    window_ms: Optional[float] = None  # the run's own unprofiled window iterations (median)
    clean_ms: Optional[float] = None
    spread_ms: Optional[tuple[float, float]] = None  # p10-p90 of the clean iterations
    graph_ms: Optional[float] = None  # the graph's own replay, where the hosts' CPU floor (iteration_ms) is above it

    def to_json(self) -> dict:
        return {"predicted_iteration_ms": round(self.iteration_ms, 3), "whatif": self.whatif,
                "graph_replay_ms": None if self.graph_ms is None else round(self.graph_ms, 3),
                "critical_path": self.critical_path, "device_busy_ms": self.device_busy_ms,
                "graph_ops": self.graph_ops, "window_ms": self.window_ms, "clean_ms": self.clean_ms,
                "clean_spread_ms": self.spread_ms, "notes": self.notes}


# ---- the graph -------------------------------------------------------------------------------------------------
def ps_graph(model: PSModel, whatif: PSWhatIf, keys: Optional[list[PSKey]] = None,
             worker_ops: Optional[dict[int, WorkerOps]] = None) -> ReplayGraph:
    """One iteration of the PS job under `whatif`: the workers' local DFGs, then the passes (workers, key
    placement, network: replay/ps_topology.py) in that order."""
    graph = local_dfgs(model, keys, worker_ops)
    if whatif.workers:
        graph = set_workers(graph, whatif.workers)
    graph = set_placement(graph, whatif.servers, whatif.bigarray_bound)
    return set_ps_network(graph, whatif.bandwidth_gbit, whatif.bandwidth_scale, whatif.links)


def local_dfgs(model: PSModel, keys: Optional[list[PSKey]] = None,
               worker_ops: Optional[dict[int, WorkerOps]] = None) -> ReplayGraph:
    """The measured workers' local DFGs, one per worker of the job (round-robin over those profiled), with the
    job's PS plan and no topology: worker r's compute ops in order on `w<r>` (gaps as "(between ops)") -> the
    push/pull dispatch latency (the In node of every key); per key, in push order, the pulled key copied into
    the parameter (MXNet's Broadcast: the key's Out node) -> the tail to the next iteration's first op."""
    keys = model.keys if keys is None else keys
    worker_ops = model.worker_ops if worker_ops is None else worker_ops
    measured = sorted(worker_ops)
    order = sorted(keys, key=lambda k: (-k.priority, k.key))
    g = GraphBuilder()
    ins, outs = [], []
    for w in range(model.workers):
        ops = worker_ops[measured[w % len(measured)]]
        device = f"w{w}"
        chain = [g.op(f"w{w}.{i}:{name}", "OTHER" if name.startswith("(") else "FW", w, device,
                      d * model.compute_scale) for i, (name, d) in enumerate(ops.ops)]
        dispatch = g.op(f"w{w}.dispatch", "QUEUE", w, None, ops.dispatch_us)
        g.chain(chain + [dispatch])
        copies = {f"k{key.key}": g.op(f"w{w}.copy k{key.key}", "IO", w, device,
                                      ops.copy_us_per_byte * key.nbytes * model.compute_scale) for key in order}
        tail = g.op(f"w{w}.tail", "OTHER", w, device, ops.tail_us * model.compute_scale)
        for copy in copies.values():
            g.edge(copy, tail)
        if not copies or ops.push_after:
            g.edge(dispatch, tail)
        ins.append(_push_ready(g, w, list(copies), chain, dispatch, ops))
        outs.append(copies)
    labelled = {f"k{key.key}": key for key in order}
    links = PSLinks(model.links, model.alpha_us, model.bytes_per_us, model.link_level, model.link_slots,
                    model.update_us, list(model.worker_hosts), list(model.server_hosts), model.copy_us, model.add_us,
                    model.host_cores)
    plan = PSPlan(model.workers, model.servers, model.bigarray_bound, list(labelled),
                  placed(labelled, model.servers, model.bigarray_bound), ins, outs, links, g.size, keys=labelled,
                  sync=model.sync, push_ratio=model.push_ratio)
    return g.build({"ps_plan": plan, "world_size": model.workers, "servers": model.servers,
                    "bigarray_bound": model.bigarray_bound, "ranks_built": model.workers, "links": model.links})


def calibration_graph(model: PSModel, nbytes: int, parts: int) -> ReplayGraph:
    """The end-of-window calibration as the topology sees it: every worker pushes and pulls one key of `nbytes`
    (split over `parts` servers), nothing else running."""
    elements = nbytes // 4
    key = PSKey(0, nbytes, elements, 0)
    bound = elements if parts > 1 else elements + 1
    idle = {r: replace(w, ops=[], dispatch_us=0.0, tail_us=0.0) for r, w in model.worker_ops.items()}
    return ps_graph(replace(model, compute_scale=1.0, link_level=1.0), PSWhatIf(bigarray_bound=bound), [key], idle)


def _push_ready(g: GraphBuilder, w: int, labels: list[str], chain: list[int], dispatch: int,
                ops: WorkerOps) -> dict[str, int]:
    """Per key (in push order), the node its push waits for: the dispatch after the whole chain, or, where the
    profile saw the i-th push start earlier (an imperative backward), a ready node after the chain's node before
    that point (with the dispatch latency)."""
    ready = {}
    for i, label in enumerate(labels):
        cut = ops.push_after[i] if i < len(ops.push_after) else len(chain)
        if cut >= len(chain):
            ready[label] = dispatch
            continue
        ready[label] = g.op(f"w{w}.ready {label}", "VIRTUAL", w, None, ops.dispatch_us)
        if cut > 0:
            g.edge(chain[cut - 1], ready[label])
    return ready


def compute_fit_moved_us(model: PSModel) -> tuple[float, float]:
    """(a worker's profiled compute, how much the compute fit moved it), µs, medians over the workers."""
    compute = median(w.compute_us for w in model.worker_ops.values()) or 0.0
    return compute, abs(model.compute_scale - 1.0) * compute


def compute_fit_disagrees(model: PSModel, reference_us: float) -> bool:
    """The fit scaled the compute far (outside x0.5-1.5) and that moved more than a tenth of the iteration: the
    profile and the job's own speed disagree (a small compute share scaled far moves little)."""
    return not 0.5 <= model.compute_scale <= 1.5 and compute_fit_moved_us(model)[1] > 0.1 * reference_us


# ---- predictions -------------------------------------------------------------------------------------------------
def absolute_layout(model: PSModel, whatif: PSWhatIf) -> PSWhatIf:
    """An absolute bandwidth asked of a one-host profile of two workers or more, no layout named: the roles laid over
    a host per worker (links "hosts"), the deployment a NIC's bandwidth describes; one medium for every transfer came
    out up to 59 % slow against such hosts (RESULTS.md, session 50). Else the what-if as asked."""
    if (whatif.bandwidth_gbit is None or whatif.links is not None or model.links != "shared" or len(model.hosts) > 1
            or (whatif.workers or model.workers) < 2):
        return whatif
    return replace(whatif, links="hosts")


def predict_ps(model: PSModel, whatif: Optional[PSWhatIf] = None) -> PSPrediction:
    whatif = absolute_layout(model, whatif or PSWhatIf())
    notes = list(model.notes)
    graph = ps_graph(model, whatif)
    result: ReplayResult = replay(graph)
    # every device the iteration used, busiest first (a top 8 once left a host's loopback out when its NICs, the
    # workers and the servers were busier)
    busy = {name: round(us / 1000.0, 3) for name, us in sorted(result.device_busy_us.items(), key=lambda kv: -kv[1])
            if us > 0}
    path = [graph.names[i] for i in result.critical_path]
    notes += _layout_check(model, whatif) + _self_check(model)
    notes += cpu_note(model.host_cpu, (whatif.servers or model.servers) - model.servers,
                      (whatif.workers or model.workers) - model.workers)
    notes += spinning_note(spinning_servers(model.host_cpu, server_work_ms(model, busy)))
    if whatif.links == "hosts" and len(model.hosts) <= 1:
        notes.append(spread_note(model, whatif))
    elif whatif.bandwidth_gbit is not None and model.links == "shared" and len(model.hosts) <= 1:
        notes.append(ABSOLUTE_PER_NODE if whatif.links == "per-node" else ABSOLUTE_ON_ONE_MEDIUM)
    if (whatif.workers or model.workers) > model.workers and (whatif.links or model.links) == "shared":
        notes.append(f"more workers on this host: they share its {model.host_cores} cores with the servers and the "
                     "loopback in the replay, each computing op on one core as profiled (not slowed further by "
                     "its neighbours)" if model.host_cores else
                     "more workers on this host: each gets its own compute device in the replay, while on the "
                     "host they would share its cores")
    if whatif.servers and whatif.servers < model.servers and len(model.hosts) > 1:
        notes.append(f"warning: fewer servers across {len(model.hosts)} hosts: on two emulated hosts the job ran "
                     "3.6-12 % faster with 1 server a host than with 2 at 1 and 3 Gbit/s (4.8 % slower at 10 Gbit/s, "
                     "and as fast with 3 a host as with 2; also with each host on a core of its own, with and "
                     "without a CPU quota: not the hosts' CPU), while this replay moved -0.4 to +3 %; what sets that "
                     "is not in the model: read this figure as up to about 15 % slow")
    elif whatif.servers and whatif.servers < model.servers and (whatif.links or model.links) == "shared":
        if model.copy_us or model.add_us:
            notes.append("fewer servers on one host: the handling of each push, the merging of the pushes, the "
                         "updates and the copies into the pulls' responses move to the remaining servers (priced "
                         "from the servers' probe); the transfers stay on the shared loopback (loopback, 2 cores, 1 "
                         "server of 2 as a ratio to the as-run replay, profiled at both counts: a conv net -0.1 % "
                         "of the measured over 20 rounds, 5 more shapes over 8-24 rounds -5.5 to +1.4 %)")
        else:
            notes.append("fewer servers on one host: the replay keeps every byte on the shared loopback and moves "
                         "only the updates (the servers did not probe their merging: a run of an older dprorun), so "
                         "this what-if is optimistic (loopback, 2 cores: 1 server measured 5-14 % slower, predicted "
                         "the same)")
    if (whatif.bigarray_bound and whatif.bigarray_bound < model.bigarray_bound and (model.copy_us or model.add_us)
            and (whatif.links or model.links) == "shared"):
        notes.append("warning: a lower big-array bound on one host: the keys it splits have their merging, updates "
                     "and transfers shared by the servers in the replay, in parallel, while on the host they take "
                     "turns on the same cores; for a conv net with one large key (3.2 MB) on loopback that was 10-17 % "
                     "optimistic in four runs of 2-4 rounds and 3 % in one of 8 (as ratios to the as-run row); "
                     "profiled at both bounds, a net with one 1 MB key -6.2 % over 12 rounds, a symbolic MLP -4.8 % "
                     "over 6, a dist_async MLP -3.5 % over 12: read this figure as up to about 17 % fast")
    if whatif.bigarray_bound and whatif.bigarray_bound != model.bigarray_bound and _sums_contexts(model):
        notes.append("warning: the workers sum each key over their contexts on the CPU (KVStoreReduce), which MXNet "
                     "splits over threads for arrays above the big-array bound: that change is not in the replay (a "
                     "conv net on 2 CPU contexts a worker, loopback, 3 rounds: 13.6 % slower with a bound of 100000, "
                     "replayed 17.7 % faster)")
    if model.compute_scale < 0.5 or model.compute_scale > 1.5:
        compute, moved = compute_fit_moved_us(model)
        reference = model.measured_iteration_us or result.iteration_time_us
        if compute_fit_disagrees(model, reference):
            notes.append(f"warning: the profiled compute was scaled by {model.compute_scale:.2f} to match the "
                         "iterations without the profiler: the profile and the job's own speed disagree widely")
        else:  # a small compute share: the factor moves little of the iteration
            notes.append(f"the profiled compute ({compute / 1000:.2f} ms a worker) was scaled by "
                         f"{model.compute_scale:.2f} to match the iterations without the profiler: "
                         f"{moved / 1000:.2f} ms of a {reference / 1000:.2f} ms iteration")
    iteration_us, graph_ms = result.iteration_time_us, None
    floor = _network_floor(model, whatif)
    if floor and floor.iteration_us > iteration_us:
        graph_ms, iteration_us = iteration_us / 1000.0, floor.iteration_us
        notes.append(f"warning: the hosts' CPU bounds this what-if, not the network: {floor.describe()}, above the "
                     f"{graph_ms:.2f} ms the replay gives the faster network alone (it prices the transfers on the "
                     f"links, not the CPU that moves them); {CPU_FLOOR_EVIDENCE}")
    clean = model.clean_iterations_us
    spread = (round(float(np.percentile(clean, 10)) / 1000, 3), round(float(np.percentile(clean, 90)) / 1000, 3)) \
        if clean else None
    window_ms = median(model.window_iterations_us)
    clean_ms = median(clean)
    return PSPrediction(iteration_us / 1000.0, whatif.describe(), _compress(path), busy, graph.size,
                        notes, None if window_ms is None else round(window_ms / 1000, 3),
                        None if clean_ms is None else round(clean_ms / 1000, 3), spread, graph_ms)


def spread_note(model: PSModel, whatif: PSWhatIf) -> str:
    """What `--links hosts` assumed of a one-host profile: the layout it replays (ps_topology.set_ps_network)."""
    workers, servers = whatif.workers or model.workers, whatif.servers or model.servers
    on_hosts = launcher_server_hosts(list(range(workers)), servers)
    each = "/".join(str(on_hosts.count(h)) for h in range(workers))
    return (f"the roles of this one-host profile laid over {workers} hosts as `dprorun --backend mxnet --hosts` "
            f"launches them: a worker on each, the {servers} servers {each} a host; each host's NIC full duplex at "
            f"the links' bandwidth, its loopback at {LOOPBACK_GBIT:g} Gbit/s, each role computing as profiled; "
            f"{SPREAD_EVIDENCE}")


# a one-host profile asked an absolute bandwidth, against plain launches on two emulated hosts with full-duplex links of
# that rate, a worker and a server on each (benchmarks/ps_bandwidth_whatif.py; RESULTS.md, session 50)
SPREAD_EVIDENCE = ("measured from loopback profiles against such hosts (two emulated hosts of 0.9 core, full-duplex "
                   "links; 3 models, 2 runs of 3 rounds): at 1 Gbit/s -8.5 to +1.9 %, at 3 Gbit/s -15.3 to -2.4 % "
                   "but a wide MLP with Adam -23.9 %, whose hosts' CPU held it back there: the target hosts' CPU is "
                   "not in a one-host profile, so a fast network's figure is a lower bound")
ABSOLUTE_ON_ONE_MEDIUM = (
    "caution: an absolute bandwidth on one medium for every transfer, asked of a profile whose roles shared one "
    "host's loopback: against two hosts with full-duplex links of that rate (a worker and a server each) this came "
    "out -11.2 to +58.6 % (3 models at 1 and 3 Gbit/s; --links hosts: -8.5 to +1.9 % at 1 Gbit/s); on this project's "
    "half-duplex 1 Gbit/s namespace, one queue for both directions, loopback profiles came out 16-49 % fast")
ABSOLUTE_PER_NODE = (
    "caution: every worker and server on a machine of its own, asked of a profile whose roles shared one host: "
    "against four emulated hosts so laid out (the workers' of 0.75 core, the servers' of 0.25) -0.6 / +2.4 % at 1 "
    "Gbit/s for an MLP and a conv net, but -17.2 % for a wide MLP with Adam and -13 to -45 % at 3 Gbit/s, where the "
    "servers' hosts' CPU held the job back: the servers' machines' CPU is not in a one-host profile, so read such a "
    "figure as a lower bound")


def server_work_ms(model: PSModel, device_busy_ms: dict[str, float]) -> dict[int, float]:
    """Each host's servers' busy time in a replayed iteration (their devices `s<i>`), by host index."""
    work: dict[int, float] = {}
    for name, ms in device_busy_ms.items():
        if name.startswith("s") and name[1:].isdigit():
            server = int(name[1:])
            host = model.server_hosts[server] if server < len(model.server_hosts) else 0
            work[host] = work.get(host, 0.0) + ms
    return work


def _sums_contexts(model: PSModel) -> bool:
    """Whether a worker's profiled iteration sums keys over several contexts (trace/mxprofile.LOCAL_REDUCE_OP)."""
    from dprorun.trace.mxprofile import LOCAL_REDUCE_OP

    return any(name == LOCAL_REDUCE_OP for ops in model.worker_ops.values() for name, _ in ops.ops)


# how far the floor was from the job measured at the faster links (benchmarks/mxnet_multihost.py --rates; RESULTS.md,
# session 22: the roles' CPU read over the clean iterations)
CPU_FLOOR_EVIDENCE = ("on two emulated 0.9-core hosts profiled at 1 Gbit/s the bound was -5.6 to +9.0 % of the job "
                      "launched at 3 and 10 Gbit/s (median |error| 3.7 %; an MLP at 1 and 2 servers a host, a conv "
                      "net, a wider MLP with Adam), where the network alone replayed 9-49 % fast: read it as within "
                      "about 10 %")


def _network_floor(model: PSModel, whatif: PSWhatIf) -> Optional[CPUFloor]:
    """The hosts' CPU floor (replay/ps_cpu.py) for a what-if of the network alone (bandwidth, or a NIC per host):
    every role keeps its host and its work, so the CPU each host's roles took an iteration stays a bound, on the
    hosts whose CPU held the job back as it ran (busy_hosts: near all their cores, or throttled by their quota). A
    host with CPU to spare spent part of its CPU time waiting (threads that spin or poll while the iteration waits for
    the network): that part shrinks with a faster network (a one-host job at 1 Gbit/s, 20 % busy, took more CPU an
    iteration than the whole of its loopback iteration allows), so it bounds nothing. None for other what-ifs
    (servers, workers, the bound, a link per role move work between hosts) and the job as it ran."""
    network = whatif.bandwidth_gbit is not None or whatif.bandwidth_scale != 1.0
    moved = any(v is not None and v != mine for v, mine in ((whatif.servers, model.servers),
                                                              (whatif.workers, model.workers),
                                                              (whatif.bigarray_bound, model.bigarray_bound)))
    if not network or moved or whatif.links not in (None, model.links, "hosts"):
        return None
    if whatif.links == "hosts" and len(model.hosts) <= 1:  # a one-host job spread over hosts: its CPU is not theirs
        return None
    return cpu_floor(busy_hosts(model.host_cpu))


SELF_CHECK_WARN = 0.03  # the job as it ran, replayed, this far from its own iterations: the fit did not hold


def _self_check(model: PSModel) -> list[str]:
    """A warning where the fitted model does not replay the job as it ran to the run's own iterations."""
    measured, as_run = model.measured_iteration_us, model.fitted_as_run_us
    if not measured or not as_run or abs(as_run / measured - 1) <= SELF_CHECK_WARN:
        return []
    return [f"warning: the job as it ran replays to {as_run / 1000:.2f} ms against its own {measured / 1000:.2f} ms "
            f"({100 * (as_run / measured - 1):+.1f} %): the costs could not be fitted to this run; read a what-if "
            f"as a ratio to {as_run / 1000:.2f} ms, not as a time"]


LAYOUT_GAP_WARN = 0.10  # the job as it ran, replayed under another links layout, this far from its own iterations


def _layout_check(model: PSModel, whatif: PSWhatIf) -> list[str]:
    """`--links hosts` on a job whose roles ran on several hosts describes the job as it ran, but its costs were
    fitted on one medium: the job as it ran (its servers, bound, workers) replayed under that layout, against the
    run's own iterations. Far apart, the layout's figures are not backed: a warning with the gap, and the ratio to
    that replay as what can be read from them. (Other layouts are deployments the job did not run on.)"""
    if whatif.links != "hosts" or model.links == "hosts" or not model.measured_iteration_us or len(model.hosts) <= 1:
        return []
    baseline = replay(ps_graph(model, PSWhatIf(links=whatif.links))).iteration_time_us
    gap = baseline / model.measured_iteration_us - 1
    if abs(gap) <= LAYOUT_GAP_WARN:
        return []
    return [f"warning: under --links {whatif.links} the job as it ran replays to {baseline / 1000:.2f} ms against its "
            f"own {model.measured_iteration_us / 1000:.2f} ms ({100 * gap:+.0f} %): the costs were fitted on "
            f"{model.links} links, so this layout's figures are off by about that much; read them against that replay "
            "(as a ratio), not as times"]


def _compress(path: list[str]) -> list[str]:
    """The critical path with runs of one worker's compute ops folded into one entry, transfers' joins left out."""
    out: list[str] = []
    for name in path:
        if name.startswith(("push ", "pull ")) and name.endswith(" done"):  # a transfer's join (SEND and RECV)
            continue
        head = name.split(":")[0].rsplit(".", 1)[0] if ":" in name else None
        if head and out and out[-1].startswith(head + ".") and ":" in out[-1]:
            out[-1] = f"{head}.compute (ops)"
        elif head and out and out[-1] == f"{head}.compute (ops)":
            continue
        else:
            out.append(name)
    return out


def format_ps_prediction(model: PSModel, prediction: PSPrediction) -> str:
    lines = [f"parameter server: {model.workers} worker{'s' * (model.workers != 1)}, {model.servers} "
             f"server{'s' * (model.servers != 1)}, {len(model.keys)} keys "
             f"({sum(k.nbytes for k in model.keys) / 1e6:.2f} MB), big-array bound {model.bigarray_bound}",
             f"links: alpha {model.alpha_us:.0f} us, {model.bytes_per_us * 8e-3:.2f} Gbit/s (fitted to "
             f"{len(model.calibration)} calibration sizes); server update {model.update_us[0]:.0f} us + "
             f"{model.update_us[1] * 1e3:.3f} us/KB; merge (copy / add of 1 MB) "
             f"{engine_us(model.copy_us, 1e6):.0f} / {engine_us(model.add_us, 1e6):.0f} us; compute "
             f"x{model.compute_scale:.2f} of the profile (to the {model.reference} iterations)"
             + (f"; {model.host_cores} cores a host, shared by its roles" if model.host_cores else ""),
             f"predicted iteration time: {prediction.iteration_ms:.2f} ms ({prediction.whatif}"
             + ("; the hosts' CPU floor: see the warning" if prediction.graph_ms is not None else "") + ")"]
    if prediction.window_ms is not None:
        lines.append(f"the run's own iterations: {prediction.window_ms:.2f} ms in the window without the profiler"
                     + (f", {prediction.clean_ms:.2f} ms after it (p10-p90 {prediction.spread_ms[0]:.2f}-"
                        f"{prediction.spread_ms[1]:.2f})" if prediction.clean_ms is not None else ""))
    lines.append(("critical path of the graph's own " + f"{prediction.graph_ms:.2f} ms: "
                  if prediction.graph_ms is not None else "critical path: ")
                 + " -> ".join(prediction.critical_path[:12])
                 + (" ..." if len(prediction.critical_path) > 12 else ""))
    lines += [f"note: {n}" for n in prediction.notes]
    return "\n".join(lines)
