"""The parameter-server topology of the global DFG: what joins the workers' local DFGs through the servers, for every
PS reader (MXNet's kvstore: replay/ps.py; BytePS's recorded stages: replay/pipeline.py), and the passes on it.

`PSPlan` (kept on a built graph, `graph.meta["ps_plan"]`) says what the topology joins: per built worker, per key,
the node its push waits for (In) and the node that waits for its pulls (Out); the keys' parts over the servers;
how transfers run (`PSLinks`). Nodes [0, local_nodes) are the workers' local DFGs; the topology's nodes follow.
Per key (in push order), per part:
  push     from every worker: on one shared medium one op on `link` (as many slots as the host moves transfers
           at once); with a link per role ("per-node") SEND on the worker's uplink `w<r>.tx`, RECV on the server's
           downlink `s<s>.rx`; with a NIC per host ("hosts": the hosts the roles ran on, or a one-host job's roles
           spread, a host per worker) SEND on the worker's host's uplink `h<a>.tx`, RECV on the server's host's
           downlink `h<b>.rx`, or, both on one host, one op on that host's loopback `h<a>.lo` (the host's cores as
           slots, priced at LOOPBACK_GBIT); SEND and RECV start together and the transfer ends when both have
           (full-duplex links carry the bytes through both at once); as
           recorded at the worker ("worker-side": BytePS) one op on the worker's own push device. Priced
           alpha + bytes / bandwidth (alpha on the op that starts the transfer), or the measured time; a dist_sync
           push's alpha is its handling by the server instead, held by the server's engine `s<s>` before the bytes
           move (the server takes every worker's push of a key in turn and answers it after the update, between
           its merges, updates and copies: fewer servers take more pushes each)
  merge    each arriving push merged on the server's engine `s<s>` (the first worker's copied into the merge
           buffer, the others' added to it: priced from the server's probes by size, `engine_us`), where the
           servers probed it
  server   once every worker's push of the part has been merged: the server's update on `s<s>` (a + b x bytes), or,
           worker-side, the measured wait between the push's end and the pull's start (no device: the server
           was not recorded)
  respond  per pull, the stored value copied into the response on `s<s>` (probed, as the merge)
  pull     to every worker, mirrored (SEND on `s<s>.tx`, RECV on `w<r>.rx` per node), into the worker's Out node
A dist_async job (`PSPlan.sync` False): no merge; each worker's push updated on its own as it arrives (`s<s>.update
<key> w<r>`), then that worker's response copied and its pull: the workers meet only on the servers and the links.
Transaction ids: (key, part's server, worker, push/pull) name the SEND/RECV pairs. A server's ops carry rank -1 - s.
Host cores (`PSLinks.host_cores`, off unless asked): each host's cores a pool `h<a>.cpu` that its workers' compute,
its servers' engines and its loopback's transfers hold while they run (`_share_host_cores`).

Passes (ReplayGraph -> ReplayGraph; each regenerates the topology where the graph has one):
  set_ps_network(graph, bandwidth_gbit, bandwidth_scale, links)  the topology, priced for that network
  set_placement(graph, servers, bigarray_bound)                   the keys re-placed as MXNet's kvstore places them
  set_workers(graph, workers)                                     the workers' local DFGs copied round-robin
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional

import numpy as np

from dprorun.fsutil import UnanswerableError
from dprorun.replay.engine import GraphBuilder, ReplayGraph, copy_ranks

HASH = 9973  # MXNet's kvstore: server = (key * 9973) % servers for a key below the big-array bound
LAYOUTS = ("shared", "per-node", "worker-side", "hosts")
# a host's loopback between roles, where roles run on several hosts (the "hosts" layout): what the shared-medium fit
# of 2 workers and 2 servers on one host of this machine gave (5.8 Gbit/s, 201 us alpha, 2 slots: 2026-12-01); the
# calibration of a multi-host job cannot tell it apart (every round trip waits for its remote worker)
LOOPBACK_GBIT = 5.8
LOOPBACK_BYTES_PER_US = LOOPBACK_GBIT * 1e9 / 8 / 1e6


@dataclass
class PSKey:
    key: int
    nbytes: int
    elements: int
    priority: int
    # the bytes a pull carries of the push's: 1, or a row-sparse key's rows pulled over its rows pushed (the hooks'
    # `row_sparse_pull` rows, runtime/mxnet.py)
    pull_ratio: float = 1.0


@dataclass
class PSPart:
    """One key's part on one server; the measured times where a reader saw them (else priced from the bytes)."""

    server: int
    nbytes: int
    push_us: Optional[float] = None
    server_us: Optional[float] = None
    pull_us: Optional[float] = None


@dataclass
class PSLinks:
    """How the transfers run and are priced, as the job ran."""

    layout: str  # one of LAYOUTS
    alpha_us: float = 0.0
    bytes_per_us: float = 125.0
    level: float = 1.0  # the job's own transfers against the calibration's (a factor on bytes_per_us)
    slots: int = 1  # transfers at once on a shared medium
    update_us: tuple[float, float] = (0.0, 0.0)  # a server's update: a + b * bytes
    # "hosts": each worker's and server's host (index); a server or worker beyond them: round-robin over the hosts
    worker_hosts: list[int] = field(default_factory=list)
    server_hosts: list[int] = field(default_factory=list)
    # the server's engine, probed ((bytes, µs) by size; empty: not priced): each arriving push merged (the first
    # worker's copied, the others' added), each pull's response copied from the stored value (engine_us)
    copy_us: tuple[tuple[float, float], ...] = ()
    add_us: tuple[tuple[float, float], ...] = ()
    # the cores of each host, shared by the work of every role on it (0: not modelled): its workers' compute and its
    # servers' engines each hold one of them while they run, and so do its loopback's transfers (_share_host_cores)
    host_cores: int = 0

    def worker_host(self, w: int) -> int:
        return self.worker_hosts[w % len(self.worker_hosts)] if self.worker_hosts else 0

    def server_host(self, s: int) -> int:
        if s < len(self.server_hosts):
            return self.server_hosts[s]
        hosts = sorted(set(self.server_hosts) | set(self.worker_hosts)) or [0]
        return hosts[s % len(hosts)]


@dataclass
class PSPlan:
    workers: int  # built workers
    servers: int
    bigarray_bound: int
    order: list[str]  # key labels in push order
    parts: dict[str, list[PSPart]]
    ins: list[dict[str, int]]  # per built worker: key -> the node its push waits for
    outs: list[dict[str, int]]  # per built worker: key -> the node that waits for its pulls
    links: PSLinks
    local_nodes: int
    keys: dict[str, PSKey] = field(default_factory=dict)  # MXNet's keys, for re-placement (empty: as recorded)
    worker_links: list[tuple[str, str]] = field(default_factory=list)  # worker-side: per worker (push, pull) device
    bandwidth_gbit: Optional[float] = None
    bandwidth_scale: float = 1.0
    layout: Optional[str] = None  # the links' layout asked (None: as the job ran)
    spread: bool = False  # the hosts in `links` laid out by the network pass (a one-host job asked "hosts")
    # dist_sync: a key's update waits for every worker's push, every pull for the update; dist_async (False): each
    # push updated on its own as it arrives, the pusher's pull answered after it (MXNet's KVStoreDistServer)
    sync: bool = True
    # the share of a part's bytes its push carries: 1, or MXNet's compressed size (2-bit: 1/16; the pulls are whole)
    push_ratio: float = 1.0

    @property
    def bytes_per_us(self) -> float:
        if self.bandwidth_gbit:
            return self.bandwidth_gbit * 1e9 / 8 / 1e6
        return self.links.bytes_per_us * self.links.level * self.bandwidth_scale


def key_parts(key: PSKey, servers: int, bound: int) -> list[tuple[int, int]]:
    """(server, bytes) of each part of `key`, as MXNet's kvstore places it: a key of fewer than `bound` elements
    whole on server (key * 9973) % servers, a larger one split evenly over every server."""
    if key.elements < bound or servers == 1:
        return [((key.key * HASH) % servers, key.nbytes)]
    item = key.nbytes / max(key.elements, 1)
    parts = []
    for s in range(servers):
        lo = int(round(key.elements / servers * s))
        hi = int(round(key.elements / servers * (s + 1)))
        parts.append((s, int((hi - lo) * item)))
    return parts


def placed(keys: dict[str, PSKey], servers: int, bound: int) -> dict[str, list[PSPart]]:
    return {label: [PSPart(s, nbytes) for s, nbytes in key_parts(key, servers, bound)] for label, key in keys.items()}


def plan_of(graph: ReplayGraph) -> PSPlan:
    plan = graph.meta.get("ps_plan")
    if plan is None:
        raise ValueError("this pass regenerates the parameter-server topology of a graph built by a PS reader "
                         "(its plan)")
    return plan


def _with_plan(graph: ReplayGraph, plan: PSPlan, had_topology: bool) -> ReplayGraph:
    """The graph's local DFGs with `plan`, its topology regenerated if it had one."""
    g = GraphBuilder.prefix_of(graph, plan.local_nodes)
    if had_topology:
        join_workers(g, plan)
    return g.build(_meta(graph.meta, plan))


def _meta(meta: dict, plan: PSPlan) -> dict:
    return dict(meta, ps_plan=plan, world_size=plan.workers, ranks_built=plan.workers, servers=plan.servers,
                bigarray_bound=plan.bigarray_bound, links=plan.layout or plan.links.layout)


def set_ps_network(graph: ReplayGraph, bandwidth_gbit: Optional[float] = None, bandwidth_scale: float = 1.0,
                   links: Optional[str] = None) -> ReplayGraph:
    """The network pass: the topology (re)generated for this bandwidth (absolute, or a factor on the job's own)
    and links' layout ("shared", "per-node", "hosts": a NIC and a loopback per host, the hosts the roles ran on, or,
    for a job that ran on one host, a host per worker with the servers spread over them as dprorun --hosts launches
    them; None: as the job ran)."""
    plan = plan_of(graph)
    several = len(set(plan.links.worker_hosts) | set(plan.links.server_hosts)) > 1
    if links is not None and links not in LAYOUTS[:2] + ("hosts",):
        raise ValueError(f"links: one of {LAYOUTS[:2] + ('hosts',)}, not {links!r}")
    if plan.links.layout == "worker-side" and (links or bandwidth_gbit):
        raise UnanswerableError("the transfers were recorded at the worker (BytePS): only a factor on their "
                                "bandwidth can be asked, not another layout or an absolute bandwidth")
    if plan.spread and links != "hosts":  # a one-host job spread by an earlier pass: back on its one host
        plan = replace(plan, spread=False, links=replace(plan.links, worker_hosts=[], server_hosts=[]))
    elif links == "hosts" and not several:  # a one-host job spread out: a host per worker, the servers over them
        if plan.workers < 2:
            raise UnanswerableError("links 'hosts': one worker, so one host: no transfer would cross a NIC (ask "
                                    "'per-node' for servers on machines of their own)")
        worker_hosts = list(range(plan.workers))
        plan = replace(plan, spread=True, links=replace(plan.links, worker_hosts=worker_hosts,
                                                        server_hosts=launcher_server_hosts(worker_hosts,
                                                                                           plan.servers)))
    plan = replace(plan, bandwidth_gbit=bandwidth_gbit, bandwidth_scale=bandwidth_scale, layout=links)
    return _with_plan(graph, plan, True)


def set_placement(graph: ReplayGraph, servers: Optional[int] = None,
                  bigarray_bound: Optional[int] = None) -> ReplayGraph:
    """The key-placement pass: the keys over `servers` servers under `bigarray_bound` (MXNet's rule)."""
    plan = plan_of(graph)
    servers = servers or plan.servers
    bound = bigarray_bound or plan.bigarray_bound
    if (servers, bound) == (plan.servers, plan.bigarray_bound):
        return graph
    if not plan.keys:
        raise UnanswerableError("the keys' placement was recorded, not derived (BytePS: the servers are not in the "
                                "files): another server count or big-array bound cannot be placed")
    links = plan.links
    if servers != plan.servers and len(set(links.server_hosts)) > 1:
        links = replace(links, server_hosts=launcher_server_hosts(links.server_hosts, servers))
    plan = replace(plan, servers=servers, bigarray_bound=bound, parts=placed(plan.keys, servers, bound), links=links)
    return _with_plan(graph, plan, graph.size > plan.local_nodes)


def launcher_server_hosts(recorded: list[int], servers: int) -> list[int]:
    """Each server's host for `servers` servers over the hosts that ran the recorded ones, as dprorun launches them
    (the same count on every host: launch_ps) and ps-lite's scheduler ranks them (a host's servers together, the hosts
    in the order of the recorded ranks: [1, 1, 0, 0] as recorded gives [1, 0] for 2). Keeping the recorded ranks'
    hosts put both of 2 servers left of 4 on one host (under `--links hosts`, two emulated hosts: +3.7 % against the
    job as it ran; laid out so +1.4 to +2.7 %; the job launched so ran 6 % faster: RESULTS.md, session 22)."""
    order = list(dict.fromkeys(recorded))
    each, extra = divmod(servers, len(order))
    return [h for i, h in enumerate(order) for _ in range(each + (1 if i < extra else 0))]


def set_workers(graph: ReplayGraph, workers: int) -> ReplayGraph:
    """The world-size pass of a PS graph: built worker b's local DFG a copy of worker b % (workers built)'s."""
    plan = plan_of(graph)
    if workers == plan.workers:
        return graph
    if plan.links.layout == "worker-side":
        raise UnanswerableError("one worker was recorded (BytePS): the other workers' pushes are inside its "
                                "measured server wait; another worker count cannot be built from it")
    period, had_topology = plan.workers, graph.size > plan.local_nodes
    g, mappings = copy_ranks(graph, plan.local_nodes, period, workers, lambda w: f"w{w}.", lambda w: f"w{w}")
    ins = [{label: int(mappings[b][node]) for label, node in plan.ins[b % period].items()} for b in range(workers)]
    outs = [{label: int(mappings[b][node]) for label, node in plan.outs[b % period].items()}
            for b in range(workers)]
    plan = replace(plan, workers=workers, ins=ins, outs=outs, local_nodes=g.size)
    if had_topology:
        join_workers(g, plan)
    return g.build(_meta(graph.meta, plan))


def join_workers(g: GraphBuilder, plan: PSPlan) -> None:
    """The PS topology (see the module doc) appended to g."""
    layout = plan.layout or plan.links.layout
    links = plan.links
    bandwidth = plan.bytes_per_us
    _share_host_cores(g, plan, layout)

    def wire(nbytes: int, measured: Optional[float]) -> float:
        return measured / plan.bandwidth_scale if measured is not None else nbytes / bandwidth

    def transfer(name: str, w: int, s: int, up: bool, seconds: float, after: int) -> int:
        """One transfer between a worker and server s, its bytes priced by `_bytes`, its fixed cost (alpha) where
        the message is handled: a dist_sync push by the server (on its engine `s<s>`, before the bytes: it
        takes every worker's push of a key in turn and answers each after the key's update, between the merges,
        updates and copies of its other keys, so fewer servers take more of them each); a pull, or a dist_async
        push (answered at once), with its bytes. Recorded at the worker (BytePS): the measured time alone, on the
        worker's own push or pull device."""
        if layout == "worker-side":
            op = g.op(name, "COMM", w, plan.worker_links[w][0 if up else 1], seconds)
            g.edge(after, op)
            return op
        if not (up and plan.sync and links.alpha_us):
            return _bytes(g, plan, layout, name, w, s, up, seconds, after, links.alpha_us)
        handle = g.op(name + " handled", "COMM", -1 - s, f"s{s}", links.alpha_us)
        g.edge(after, handle)
        return _bytes(g, plan, layout, name, w, s, up, seconds, handle)

    for label in plan.order:
        key = plan.keys.get(label)
        pull_ratio = key.pull_ratio if key is not None else 1.0
        for part in plan.parts[label]:
            s = part.server
            pulled = part.nbytes * pull_ratio
            if not plan.sync:  # each worker's push updated on its own, its pull answered from the value it made
                for w in range(plan.workers):
                    push = transfer(f"push {label}.s{s} w{w}->s{s}", w, s, True,
                                    wire(part.nbytes * plan.push_ratio, part.push_us), plan.ins[w][label])
                    update = g.op(f"s{s}.update {label} w{w}", "UPDATE", -1 - s, f"s{s}",
                                  links.update_us[0] + links.update_us[1] * part.nbytes)
                    g.edge(push, update)
                    respond = _server_op(g, links, f"s{s}.respond {label} w{w}", s, pulled, False, update)
                    g.edge(transfer(f"pull {label}.s{s} s{s}->w{w}", w, s, False, wire(pulled, part.pull_us),
                                    respond), plan.outs[w][label])
                continue
            arrivals = [transfer(f"push {label}.s{s} w{w}->s{s}", w, s, True,
                                 wire(part.nbytes * plan.push_ratio, part.push_us), plan.ins[w][label])
                        for w in range(plan.workers)]
            if part.server_us is not None:  # the wait at the server, as the worker saw it
                server = g.op(f"s{s}.wait {label}", "VIRTUAL", -1 - s, None, part.server_us)
                for recv in arrivals:
                    g.edge(recv, server)
            else:
                server = g.op(f"s{s}.update {label}", "UPDATE", -1 - s, f"s{s}",
                              links.update_us[0] + links.update_us[1] * part.nbytes)
                for w, recv in enumerate(arrivals):
                    g.edge(_server_op(g, links, f"s{s}.merge {label} w{w}", s, part.nbytes, w > 0, recv), server)
            for w in range(plan.workers):
                respond = server if part.server_us is not None else _server_op(
                    g, links, f"s{s}.respond {label} w{w}", s, pulled, False, server)
                recv = transfer(f"pull {label}.s{s} s{s}->w{w}", w, s, False, wire(pulled, part.pull_us), respond)
                g.edge(recv, plan.outs[w][label])


def _bytes(g: GraphBuilder, plan: PSPlan, layout: str, name: str, w: int, s: int, up: bool, seconds: float,
           after: int, alpha: float = 0.0) -> int:
    """The bytes of one transfer between worker w and server s (`up`: a push), with `alpha` on the op that starts
    it: SEND on the sender's link, RECV on the receiver's, or one op on a shared medium (a host's loopback with a
    NIC per host)."""
    links = plan.links
    if layout == "hosts":
        a, b = (links.worker_host(w), links.server_host(s)) if up else (links.server_host(s), links.worker_host(w))
        if a == b:  # both roles on one host: its loopback
            op = g.op(name, "COMM", w, f"h{a}.lo", alpha + seconds * plan.bytes_per_us / LOOPBACK_BYTES_PER_US,
                      capacity=links.slots)
            g.edge(after, op)
            return op
        sender, receiver = f"h{a}.tx", f"h{b}.rx"
    elif layout == "shared":
        op = g.op(name, "COMM", w, "link", alpha + seconds, capacity=links.slots)
        g.edge(after, op)
        return op
    else:
        sender, receiver = (f"w{w}.tx", f"s{s}.rx") if up else (f"s{s}.tx", f"w{w}.rx")
    # the bytes cross the sender's link up and the receiver's link down at once (full duplex, pipelined): once the
    # sender's link takes the transfer (its start: the fixed cost), its bytes hold that link (SEND) and the
    # receiver's (RECV) side by side, the transfer done when both are (one after the other priced every transfer
    # twice: a two-host job under "hosts" replayed at 110 ms for its 66 ms; RESULTS.md, session 50)
    start = g.op(name, "COMM", w, sender, alpha)
    g.edge(after, start)
    send = g.op(name + " SEND", "COMM", w, sender, seconds)
    recv = g.op(name + " RECV", "COMM", w, receiver, seconds)
    done = g.op(name + " done", "VIRTUAL", w, None, 0.0)
    for op in (send, recv):
        g.edge(start, op)
        g.edge(op, done)
    return done


def _share_host_cores(g: GraphBuilder, plan: PSPlan, layout: str) -> None:
    """The hosts' cores as pools (GraphBuilder.share), `host_cores` each: every worker's compute device and every
    server's engine hold one of their host's while they run; on one host its loopback's transfers too (one medium,
    or `h<a>.lo` with a NIC per host; a medium between hosts, or a NIC, holds none). None with a link per role (each
    on a machine of its own) or when the cores are not modelled. The topology owns the pools: any the graph had are
    replaced."""
    g.pool = {}
    cores = plan.links.host_cores
    if not cores or layout not in ("shared", "hosts"):
        return
    links = plan.links
    hosts = {links.worker_host(w) for w in range(plan.workers)} | {links.server_host(s) for s in range(plan.servers)}
    for w in range(plan.workers):
        g.share(f"w{w}", f"h{links.worker_host(w)}.cpu", cores)
    for s in range(plan.servers):
        g.share(f"s{s}", f"h{links.server_host(s)}.cpu", cores)
    if layout == "shared" and len(hosts) == 1:
        g.share("link", f"h{hosts.pop()}.cpu", cores)
    elif layout == "hosts":
        for host in sorted(hosts):
            g.share(f"h{host}.lo", f"h{host}.cpu", cores)


def engine_us(probed: tuple[tuple[float, float], ...], nbytes: float) -> float:
    """µs of a copy or add of `nbytes` on a server's engine from its probes ((bytes, µs) by size): linear between
    the probed sizes and from 0 below the smallest (no fitted intercept: a line through the large sizes would
    price a 64-byte key like a large one), the largest size's rate above it; 0 where nothing was probed."""
    if not probed:
        return 0.0
    sizes, times = [0.0] + [b for b, _ in probed], [0.0] + [t for _, t in probed]
    if nbytes >= sizes[-1]:
        return times[-1] * nbytes / sizes[-1]
    return float(np.interp(nbytes, sizes, times))


def _server_op(g: GraphBuilder, links: PSLinks, name: str, s: int, nbytes: int, add: bool, after: int) -> int:
    """A copy (or an add) of `nbytes` on server s's engine after node `after`; `after` itself where the servers'
    engine was not probed."""
    probed = links.add_us if add else links.copy_us
    if not probed:
        return after
    op = g.op(name, "IO", -1 - s, f"s{s}", engine_us(probed, nbytes))
    g.edge(after, op)
    return op
