"""The communication topology of the global DFG, and its price: what joins the ranks' local DFGs.

`CommPlan` (kept on a built graph, `graph.meta["comm_plan"]`) says what the topology joins: each collective's
In nodes (per piece) and Out nodes on every built rank. `set_network(graph, ...)` is the network pass: it
(re)generates the topology of a graph from its plan, priced by `CommPricing` for the link bandwidth and latency
asked (none: the job's own network), and replaces whatever topology the graph had. `synthesize` joins the ranks
with it. Per collective and piece: a step-level ring (`ring_allreduce`: 2(N-1) steps; each rank's SEND on its
outgoing link, the receiver's RECV joining it), the collapsed ring for large built worlds (`collapsed_allreduce`),
or Daydream's baseline (`daydream_sync`: bytes / bandwidth on the rank's own device, no cross-rank edge).

`set_world_size(graph, world)` is the world-size pass: the ranks' local DFGs the graph holds are copied round-robin
to the ranks the new world builds (symmetry: a ring whose ranks repeat every m built ranks is built for m only,
rank 0 receiving from rank m-1: exact), the plan's In and Out nodes with them, and the topology regenerated for
that world (the collapsed ring beyond COLLAPSE_FROM_RANKS built ranks).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from dprorun.fsutil import UnanswerableError
from dprorun.replay.engine import GraphBuilder, ReplayGraph, copy_ranks
from dprorun.replay.template import JobModel, MeasuredIteration
from dprorun.replay.whatif import Sync, WhatIf, comm_scale, hook_work_us_per_byte


COLLAPSE_FROM_RANKS = 64


@dataclass
class CommPlan:
    """What the topology of a built graph joins. Nodes [0, local_nodes) are the ranks' local DFGs (their In and
    Out nodes included); the topology's nodes follow them."""

    model: JobModel  # with the question's ready groups
    whatif: WhatIf  # the question the graph was built for (network included)
    syncs: list[Sync]
    measured_layout: bool
    sample: Optional[MeasuredIteration]
    ins: dict[tuple[str, int], list[int]]  # (collective, piece) -> In node per built rank
    outs: dict[str, list[int]]  # collective -> Out node per built rank
    world: int
    collapse: bool
    local_nodes: int
    enqueue_us: list[float]  # per built rank: DDP's hook handing one collective over (0: none measured)


def fsdp_world_caution(calls: int, measured_world: int, world: int, alpha_us: float) -> str:
    """What a world-size answer for FSDP on the CPU rests on: its blocking calls' added ring messages, each priced at
    the clock probes' message latency, none hidden behind compute."""
    messages = calls * 2 * abs(world - measured_world)
    return (f"caution: FSDP's {calls} blocking calls a step each {'gain' if world > measured_world else 'lose'} "
            f"{2 * abs(world - measured_world)} ring messages at {world} ranks, {messages * alpha_us / 1000:.1f} ms a "
            f"step at the {alpha_us:.0f} µs a message the clock probes measured, none hidden behind compute: where a "
            f"message costs more on the target machines (hosts with fewer cores than their ranks' threads: about 1 ms "
            f"a hop on this project's emulated 4-host cluster, where this answer came out 18-36 % short), each of the "
            f"{messages} adds its excess to the step")


def set_network(graph: ReplayGraph, bandwidth_gbit: Optional[float] = None, bandwidth_scale: float = 1.0,
                latency_us: Optional[float] = None, notes: Optional[list[str]] = None) -> ReplayGraph:
    """The network pass: the graph's topology regenerated from its plan for this link bandwidth (absolute, or a
    scale of the measured one) and per-step latency; None and 1.0: the job's own network (measured transmissions
    where the plan's layout is the one measured)."""
    plan = plan_of(graph)
    whatif = replace(plan.whatif, bandwidth_gbit=bandwidth_gbit, bandwidth_scale=bandwidth_scale,
                     latency_us=latency_us)
    pricing = CommPricing.for_whatif(plan.model, whatif, plan.world, plan.measured_layout,
                                     notes if notes is not None else [])
    plan = replace(plan, whatif=whatif)
    g = GraphBuilder.prefix_of(graph, plan.local_nodes)
    join_ranks(g, plan, pricing)
    return g.build(dict(graph.meta, comm_plan=plan))


def set_world_size(graph: ReplayGraph, world: int, fold: bool = True,
                   notes: Optional[list[str]] = None) -> ReplayGraph:
    """The world-size pass (see the module doc). `fold=False` builds every rank even where the ring repeats."""
    plan = plan_of(graph)
    notes = notes if notes is not None else []
    period = int(graph.meta["ranks_built"])  # the ranks whose local DFGs the graph holds, cycled through
    ring = plan.model.ring_size if world == plan.model.world_size else world  # the script's groups: their rings'
    built = period if fold and world > period and world % period == 0 and ring % period == 0 \
        and _groups_alike(plan.model) else world
    collapse = built > COLLAPSE_FROM_RANKS and plan.whatif.baseline != "daydream"
    if world == plan.world and built == period and collapse == plan.collapse:
        return graph
    model = plan.model
    if model.ddp_groups and world != model.world_size:
        raise UnanswerableError(f"the script's DDP all-reduces within process groups of its own "
                                f"({model.ddp_groups_text()}): the groups at another world size "
                                "are the script's choice, which dprorun does not know")
    if model.fsdp_subgroup_sizes and world != model.world_size:
        raise UnanswerableError(f"FSDP's calls run within groups of its device mesh (of "
                                f"{', '.join(map(str, model.fsdp_subgroup_sizes))} ranks; HSDP: sharded within, "
                                "replicated across): the mesh at another world size is the script's choice, which "
                                "dprorun does not know")
    if model.framework == "horovod" and plan.measured_layout and world != model.world_size \
            and plan.whatif.baseline != "daydream":
        raise UnanswerableError("Horovod fuses tensors into responses at run time: another world size re-plans "
                                "them (synthesize the graph for that question)")
    if world > period:
        notes.append(f"{world} ranks synthesised from the {period} measured ranks' templates "
                     "(round-robin); compute contention between ranks on one host is not modelled")
    if collapse:
        notes.append(f"{built} ranks built: each collective replayed as one op per rank that starts when every "
                     f"rank is ready (step-level rings up to {COLLAPSE_FROM_RANKS} ranks: N^2 ops)")
    had_topology = graph.size > plan.local_nodes
    g, ins, outs = _copy_ranks(graph, plan, period, built)
    plan = replace(plan, whatif=replace(plan.whatif, world_size=world), ins=ins, outs=outs, world=world,
                   collapse=collapse, local_nodes=g.size,
                   enqueue_us=[plan.enqueue_us[b % period] for b in range(built)] if plan.enqueue_us else [])
    local = g.build(dict(graph.meta, world_size=world, ranks_built=built, comm_plan=plan))
    if not had_topology:
        return local
    return set_network(local, plan.whatif.bandwidth_gbit, plan.whatif.bandwidth_scale, plan.whatif.latency_us)


def _groups_alike(model: JobModel) -> bool:
    """Every one of the script's DDP groups (if it has any) of one size: their rings repeat as one would."""
    return len({len(group) for group in model.ddp_groups}) <= 1


def rings(plan: CommPlan, built: int) -> list[tuple[Optional[list[int]], int]]:
    """The rings the plan's collectives run in: [(the built ranks in the ring, in ring order, None: all of them;
    the ring's size)]. One ring of the plan's world (built ranks fewer: its repeating part); a script's own DDP
    groups at the job's world: a ring per group, of the built ranks that are its ranks (ranks folded: the groups'
    repeating part)."""
    groups = plan.model.ddp_groups
    if not groups or plan.world != plan.model.world_size:
        return [(None, plan.world)]
    if built < plan.world:
        return [(None, len(groups[0]))]
    measured = sorted(plan.sample.templates if plan.sample is not None else plan.model.templates)
    position = {rank: b for b, rank in enumerate(measured)}
    whole = [members for members in ([position[rank] for rank in group if rank in position] for group in groups)
             if len(members) > 1]
    joined = {b for members in whole for b in members}
    return [(members, len(members)) for members in whole] + [([b], 1) for b in range(built) if b not in joined]


def plan_of(graph: ReplayGraph) -> "CommPlan":
    plan = graph.meta.get("comm_plan")
    if plan is None:
        raise ValueError("this pass regenerates the topology of a graph as synthesize built it (its communication "
                         "plan); a coarsened graph has none: coarsen after this pass")
    return plan


def _copy_ranks(graph: ReplayGraph, plan: "CommPlan", period: int,
                built: int) -> tuple[GraphBuilder, dict, dict]:
    """Built rank b's local DFG: a copy of rank b % period's (names and devices renumbered), and the plan's In /
    Out nodes per built rank."""
    g, mappings = copy_ranks(graph, plan.local_nodes, period, built, lambda r: f"r{r}.", lambda r: f"rank{r}.")
    ins = {key: [int(mappings[b][per_rank[b % period]]) for b in range(built)] for key, per_rank in plan.ins.items()}
    outs = {key: [int(mappings[b][per_rank[b % period]]) for b in range(built)]
            for key, per_rank in plan.outs.items()}
    return g, ins, outs


def join_ranks(g: GraphBuilder, plan: CommPlan, pricing: "CommPricing") -> None:
    """Every collective's topology between its In and Out nodes, appended to g."""
    whatif, model = plan.whatif, plan.model
    for s in plan.syncs:
        pieces = 1 if s.sparse else whatif.pieces(s.key)
        for p in range(pieces):
            ins, outs = plan.ins[(s.key, p)], plan.outs[s.key]
            if whatif.baseline == "daydream":
                daydream_sync(g, s, p, pieces, ins, outs, pricing, model.channels)
            elif plan.world == 1:
                for u, v in zip(ins, outs):
                    g.edge(u, v)
            else:
                topology = collapsed_allreduce if plan.collapse else ring_allreduce
                for members, size in rings(plan, len(outs)):
                    duration, latency = pricing.step(s, pieces, plan.sample, ring=size)
                    chosen = members if members is not None else range(len(outs))
                    topology(g, f"{s.key}.p{p}", [ins[b] for b in chosen], [outs[b] for b in chosen], size,
                             duration, latency, model.channels, split=pricing.split(s, plan.sample),
                             members=members)


def _outside_bound(outside_us: float, measured_world: int, world: int) -> str:
    """How far collectives kept as measured could move a world-size prediction: a ring's steps grow as (N-1), so at
    `world` ranks they could take (world-1)/(measured_world-1) times as long (an all-gather's bytes grow so too)."""
    if world <= measured_world or measured_world < 2:
        return ""
    more = outside_us * ((world - 1) / (measured_world - 1) - 1)
    return (f"; were they to grow with the ring's steps, the step would take up to {more / 1000:.1f} ms more "
            f"(x{(world - 1) / (measured_world - 1):.2g} of them)")


@dataclass
class CommPricing:
    """How long one ring step of a collective takes: measured (the job as it ran: each bucket's measured
    transmission spread over its steps) or modelled (the cost model scaled to the measured transmissions; a
    world-size change alone adds the longer ring's messages and bytes to the collective as measured)."""

    model: JobModel
    world: int
    use_measured: bool
    ring_delta: bool
    scale: float
    bandwidth: float  # bytes/µs
    alpha_us: float
    hook_us_per_byte: float = 0.0  # a comm hook's own work per byte it sends (whatif.hook_work_us_per_byte)
    # a world-size change of a job whose collectives are the script's own calls, laid out as measured: each adds the
    # longer ring's messages and bytes to its own measured transmission (that iteration's), not to the scaled model:
    # a call's record holds the script's work before it (a loop's division, a flat buffer's copies), which a price
    # by bytes puts elsewhere (a conv net's tutorial loop at 3 ranks came out 29 % below its run at 2)
    delta_on_measured: bool = False

    @classmethod
    def for_whatif(cls, model: JobModel, whatif: WhatIf, world: int, measured_layout: bool,
                   notes: list[str]) -> "CommPricing":
        comm = model.comm
        scale = comm_scale(model)
        bandwidth = comm.bandwidth_bytes_per_us * whatif.bandwidth_scale
        if whatif.bandwidth_gbit is not None:  # the link asked for; `scale` (what the job's own transmissions took
            # beyond the model's price) applies to it once, in `step`, as to the job's own bandwidth (it was divided
            # in here as well: scale squared on the bytes, a what-if at the run's own bandwidth off the run by scale)
            bandwidth = whatif.bandwidth_gbit * 1e3 / 8.0
        network_same = whatif.latency_us is None and whatif.bandwidth_gbit is None and whatif.bandwidth_scale == 1.0
        use_measured = measured_layout and world == model.world_size and max(1, whatif.partitions) == 1 \
            and network_same and not whatif.bucket_partitions
        ring_delta = model.network is not None and world != model.world_size and network_same \
            and whatif.baseline != "daydream"
        if ring_delta:
            notes.append(f"{world} ranks: each collective as measured at {model.world_size} ranks plus the longer "
                         f"ring's messages ({comm.alpha_us:.0f} µs each) and bytes at the calibrated "
                         f"{model.network.bandwidth_bytes_per_us * 8e-3:.3g} Gbit/s")
            if model.blocking_collectives:
                notes.append(fsdp_world_caution(len(model.buckets), model.world_size, world, comm.alpha_us))
        if model.ddp_buffer_bytes and (world != model.world_size or not network_same):
            owners = model.ddp_buffer_owners
            held = (f" of {', '.join(owners[:4])}{', ...' if len(owners) > 4 else ''}" if owners
                    else ": BatchNorm's running statistics, a quantizer's observers, ...")
            notes.append(f"DDP broadcasts its modules' buffers ({model.ddp_buffer_bytes / 1024:.1f} KB{held}) from its "
                         "first rank before every training forward: replayed inside "
                         f"the forward as measured at {model.world_size} ranks on this network, not priced again for "
                         "this what-if (broadcast_buffers=False leaves it out)")
        if model.world_size < 2 and world > 1:
            asked = whatif.bandwidth_gbit is not None
            gbit = comm.bandwidth_bytes_per_us * 8e-3
            link = (f"the {whatif.bandwidth_gbit:g} Gbit/s asked for" if asked else
                    f"an assumed {gbit:.3g} Gbit/s link" if comm.source.startswith("assumed") else
                    f"the {gbit:.3g} Gbit/s of its lone rank's own collectives")
            notes.append(f"warning: profiled on 1 rank, whose all-reduces crossed no network: the {world}-rank figure "
                         f"prices them at {link} and an assumed {comm.alpha_us:.0f} µs a message, not by a "
                         "measurement; profile 2 ranks or more (--local-np 2) for a figure backed by one"
                         + ("" if asked else ", or give the link's bandwidth (--bandwidth)"))
        names, outside_us = model.collectives_outside_packs
        if outside_us > 0 and (world != model.world_size or not network_same):
            notes.append(f"caution: {outside_us / 1000:.1f} ms a step of collectives outside the gradient packs "
                         f"or buckets ({', '.join(names[:4])}{', ...' if len(names) > 4 else ''}: a sparse "
                         "gradient's all-gathers, metric reductions, the all-reduces of step functions called before "
                         "the step's last one, the script's own calls in its step, its point-to-point transfers) are "
                         "replayed as measured at "
                         f"{model.world_size} ranks on this network, "
                         "not priced again for this what-if"
                         + _outside_bound(outside_us, model.world_size, world))
        alpha = comm.alpha_us if whatif.latency_us is None else whatif.latency_us
        hook_us = hook_work_us_per_byte(model)
        if hook_us > 0 and not use_measured:
            notes.append(f"the script's comm hook works on the gradients beyond sending them ({hook_us * 1e3:.2f} µs a "
                         "KB it sends, measured): kept as it ran, its transmission priced for this what-if")
        return cls(model, world, use_measured, ring_delta, scale, bandwidth, alpha, hook_us,
                   delta_on_measured=ring_delta and measured_layout and model.framework == "collectives")

    def measured_us(self, sync: Sync, sample: Optional[MeasuredIteration]) -> Optional[float]:
        measured = sample.transmit_us.get(sync.key, sync.measured_us) if sample is not None else sync.measured_us
        return measured if self.use_measured and measured else None

    def split(self, sync: Sync, sample: Optional[MeasuredIteration]) -> bool:
        """Modelled steps of a backend with several channels: latency on a channel, bytes on the link."""
        return self.measured_us(sync, sample) is None and self.model.channels > 1

    def step(self, sync: Sync, pieces: int, sample: Optional[MeasuredIteration],
             ring: Optional[int] = None) -> tuple[float, float]:
        """(one ring step's duration, the part of it that is latency rather than bytes on the link), for a ring of
        `ring` ranks (the script's own DDP groups; default: the world)."""
        world = ring or self.world
        steps = 2 * max(world - 1, 1)
        measured = self.measured_us(sync, sample)
        if measured is not None:
            return measured / steps, 0.0
        nbytes = sync.nbytes / pieces
        model, comm = self.model, self.model.comm
        grown = nbytes * self.world / model.world_size if sync.grows_with_world else nbytes  # each rank's share
        if sync.sparse:  # gloo gathers every rank's indices and values: N-1 messages of them reach each rank
            latency = comm.collective_us + (world - 1) * self.alpha_us
            total = self.scale * (latency + (world - 1) * nbytes / self.bandwidth)
            return total / steps, self.scale * latency / steps
        hook_us = self.hook_us_per_byte * nbytes / steps  # a hook's own work, spread over the steps: no link's
        if self.ring_delta:
            net_bw = model.network.bandwidth_bytes_per_us
            as_measured = sample.transmit_us.get(sync.key, sync.measured_us) if sample is not None \
                else sync.measured_us
            total = (as_measured if self.delta_on_measured and as_measured and pieces == 1
                     else self.scale * comm.allreduce_us(nbytes, model.world_size)) \
                + 2 * (self.world - model.world_size) * comm.alpha_us \
                + (_wire_share(self.world) * grown - _wire_share(model.world_size) * nbytes) / net_bw
            wire = _wire_share(self.world) * grown / net_bw
            return total / steps + hook_us, max(0.0, total - wire) / steps + hook_us
        latency = comm.step_latency_us(world, self.alpha_us)
        return (self.scale * (latency + grown / (world * self.bandwidth)) + hook_us,
                self.scale * latency + hook_us)


def _wire_share(n: int) -> float:
    return 2 * (n - 1) / n if n > 1 else 0.0


def _ring_labels(built: int, world: int, members: Optional[list[int]]) -> tuple[list[int], list[int]]:
    """(each ring position's built rank, the built rank it sends to): positions 0..built-1 of a ring of `world`
    (built < world: its repeating part, the last one sending on towards rank `built`), or the given members, a
    whole ring of their own (the last sending to the first)."""
    if members is not None:
        return list(members), list(members[1:]) + list(members[:1])
    return list(range(built)), [(r + 1) % world for r in range(built)]


def ring_allreduce(g: GraphBuilder, key: str, ins: list[int], outs: list[int], world: int, duration: float,
                   latency: float, channels: int, split: bool, members: Optional[list[int]] = None) -> None:
    """A step-level ring of 2(N-1) steps between the built ranks' In and Out nodes: at each step every rank's
    SEND occupies its outgoing link and the right neighbour's RECV (no device) joins it; the next step needs
    both the rank's own SEND and RECV. Built < world: the ring's repeating part, rank 0 receiving from the last
    built rank. `members`: the built ranks the positions are (a ring of a script's own DDP group), in ring order."""
    built = len(ins)
    labels, right = _ring_labels(built, world, members)
    previous = {r: [ins[r]] for r in range(built)}
    for step in range(2 * (world - 1)):
        sends = {}
        for r, rank in enumerate(labels):
            link = f"{rank}->{right[r]}"
            if split:
                lat = g.op(f"r{rank}.latency.{key}.s{step}", "COMM", rank, f"channel{link}", latency,
                           capacity=channels)
                for u in previous[r]:
                    g.edge(u, lat)
                previous[r] = [lat]
                sends[r] = g.op(f"r{rank}.send.{key}.s{step}", "COMM", rank, f"link{link}", duration - latency)
            else:
                sends[r] = g.op(f"r{rank}.send.{key}.s{step}", "COMM", rank, f"link{link}", duration,
                                capacity=channels)
        current = {}
        for r, rank in enumerate(labels):
            recv = g.op(f"r{rank}.recv.{key}.s{step}", "VIRTUAL", rank, None, 0.0)
            g.edge(sends[(r - 1) % built], recv)
            current[r] = [sends[r], recv]
        for r in range(built):
            for u in previous[r]:
                g.edge(u, sends[r])
        previous = current
    for r in range(built):
        for u in previous[r]:
            g.edge(u, outs[r])


def collapsed_allreduce(g: GraphBuilder, key: str, ins: list[int], outs: list[int], world: int, duration: float,
                        latency: float, channels: int, split: bool, members: Optional[list[int]] = None) -> None:
    """The whole ring as one op per rank, after every rank's ready point (large rings: N ops, not N^2);
    `members` as for `ring_allreduce`."""
    labels, right = _ring_labels(len(ins), world, members)
    join = g.op(f"join.{key}" if members is None else f"join.{key}.r{labels[0]}", "VIRTUAL", labels[0], None, 0.0)
    for r, (u, v) in enumerate(zip(ins, outs)):
        g.edge(u, join)
        op = g.op(f"r{labels[r]}.allreduce.{key}", "COMM", labels[r], f"link{labels[r]}->{right[r]}",
                  duration * 2 * (world - 1), capacity=channels)
        g.edge(join, op)
        g.edge(op, v)


def daydream_sync(g: GraphBuilder, sync: Sync, piece: int, pieces: int, ins: list[int], outs: list[int],
                  pricing: CommPricing, channels: int) -> None:
    """Daydream's baseline: bytes / bandwidth on the rank's own comm device, no cross-rank dependency."""
    for r, (u, v) in enumerate(zip(ins, outs)):
        op = g.op(f"r{r}.comm.{sync.key}.p{piece}", "COMM", r, f"rank{r}.comm",
                  sync.nbytes / pieces / pricing.bandwidth, capacity=channels)
        g.edge(u, op)
        g.edge(op, v)
