"""What-if questions and what they mean for the collectives: `WhatIf` (world size, bandwidth, latency, bucket
size or explicit grouping, partitions, accumulation, re-computation, compiled regions, per-op scale, Horovod's
fusion knobs), and the bucket plan of a question (`plan_syncs`: the measured layout, DDP's re-bucketing,
Horovod's cycle/threshold fusion; `with_ready_groups`: compiled regions' gradients ready together).

The graph they are replayed on is built by `replay/synthesize.py`; predictions by `replay/predict.py`.
"""
from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields, replace
from typing import Optional

import numpy as np

from dprorun.fsutil import UnanswerableError
from dprorun.replay.template import JobModel, ddp_buckets, horovod_knobs_as_run

MB = 1 << 20

FSDP_RESTRUCTURED = ("FSDP on the CPU: the question restructures the step (re-bucketing, partitions, re-computation or "
                     "accumulation) around FSDP's own gathers and reduce-scatters, which dprorun does not model; world "
                     "size, bandwidth, latency and compute what-ifs are answered")


@dataclass
class WhatIf:
    world_size: Optional[int] = None
    bandwidth_gbit: Optional[float] = None  # absolute link bandwidth
    bandwidth_scale: float = 1.0
    latency_us: Optional[float] = None  # per ring step
    bucket_mb: Optional[float] = None
    partitions: int = 1
    buckets: Optional[list[list[str]]] = None  # explicit grouping (the optimizer's tensor fusion)
    bucket_partitions: dict[str, int] = field(default_factory=dict)  # per bucket key ("bucket3"): pieces
    accumulation_steps: int = 1  # micro-batches per optimizer step (same global batch)
    recompute_segments: int = 0  # activation checkpointing in this many segments (0: none)
    horovod_fusion_mb: Optional[float] = None  # Horovod: fusion threshold (0: no fusion)
    horovod_cycle_ms: Optional[float] = None  # Horovod: cycle time
    forward_scale: float = 1.0  # model forward time x this (op fusion / precision, from measured variants)
    backward_scale: float = 1.0  # model backward compute x this
    # compiled regions: each group's gradients become ready together, at its latest (a region's backward is one
    # graph): [every parameter] for a compiled model (no overlap with backward), one group per compiled block
    ready_groups: Optional[list[list[str]]] = None
    # per-op what-if: profiled ops whose name, module scope or name@scope matches the glob pattern take x factor
    op_scale: dict[str, float] = field(default_factory=dict)
    baseline: str = "dpro"  # or "daydream"

    # the questions that change what is communicated or when (the one place that knows it)
    COMMUNICATION_FIELDS = frozenset({"world_size", "bucket_mb", "buckets", "partitions", "bucket_partitions",
                                      "horovod_fusion_mb", "horovod_cycle_ms", "ready_groups",
                                      "accumulation_steps"})

    def asked(self) -> set[str]:
        """The fields that ask something (differ from the job as it ran); `baseline` is how, not what."""
        changed = set()
        for spec in fields(self):
            default = spec.default_factory() if spec.default_factory is not MISSING else spec.default
            value = getattr(self, spec.name)
            if spec.name != "baseline" and value != default and not (value in (None, {}, []) and not default):
                changed.add(spec.name)
        return changed

    def is_identity(self) -> bool:
        return not self.asked()

    def changes_communication(self) -> bool:
        return bool(self.asked() & self.COMMUNICATION_FIELDS)

    def pieces(self, bucket_key: str) -> int:
        return max(1, int(self.bucket_partitions.get(bucket_key, self.partitions)))


@dataclass
class Sync:
    key: str
    nbytes: int
    ready_fraction: float
    measured_us: Optional[float]
    delay_us: float = 0.0  # after its ready point, before it can start (Horovod: cycle negotiation)
    sparse: bool = False  # one sparse gradient (BucketInfo.sparse): priced as a gather of every rank's bytes
    after_update: bool = False  # a sharded step's parameter gather: handed over by the update, before the tail
    # compressed gradients all-gathered by hand: each rank's share fixed, so the bytes grow with the ranks (nbytes:
    # at the measured world size)
    grows_with_world: bool = False


def horovod_fusion(model: JobModel, threshold_bytes: float, cycle_us: float) -> list[tuple[list[str], float, float]]:
    """Horovod's tensor fusion, as its background loop does it: every `cycle_us` the tensors that became ready
    since the last cycle are negotiated (one round among the ranks per cycle) and fused, in ready order, into
    responses of at most `threshold_bytes`, each of one dtype (`_fuse_cycle`). Returns each response's tensors, its
    ready fraction of the backward pass (the end of the cycle that picked it up, capped at the end of backward) and
    the delay after that point before it can start: the cycle's negotiation (`JobModel.horovod_negotiation_us`) plus
    the part of the cycle that runs past the end of backward."""
    backward = float(np.median([t.backward_us for t in model.templates.values()])) or 1.0
    negotiation = model.horovod_negotiation_us
    order = sorted(model.param_ready_fraction, key=model.param_ready_fraction.get)
    sparse = model.sparse_gradients()  # all-gathered, each a response of its own
    wire = model.wire_ratio()  # hvd.Compression.fp16: responses fill with the compressed bytes
    dtypes = model.param_dtypes() or {}
    responses: list[tuple[list[str], float, float]] = []
    pending: list[tuple[str, float, str]] = []  # the current cycle's dense tensors: (name, bytes, dtype)
    current_cycle, current_end, current_delay = None, 1.0, negotiation
    for name in order:
        ready_us = model.param_ready_fraction[name] * backward
        cycle = int(ready_us // cycle_us) + 1 if cycle_us > 0 else ready_us
        if name in sparse:
            end_us = cycle * cycle_us if cycle_us > 0 else ready_us
            responses.append(([name], min(1.0, end_us / backward), negotiation + max(0.0, end_us - backward)))
            continue
        if pending and cycle != current_cycle:
            responses += [(group, current_end, current_delay) for group in _fuse_cycle(pending, threshold_bytes)]
            pending = []
        if not pending:
            current_cycle = cycle
            cycle_end_us = cycle * cycle_us if cycle_us > 0 else ready_us
            current_end = min(1.0, cycle_end_us / backward)
            current_delay = negotiation + max(0.0, cycle_end_us - backward)
        pending.append((name, wire * model.param_bytes.get(name, 0), dtypes.get(name, "")))
    if pending:
        responses += [(group, current_end, current_delay) for group in _fuse_cycle(pending, threshold_bytes)]
    return responses


def _fuse_cycle(tensors: list[tuple[str, float, str]], threshold_bytes: float) -> list[list[str]]:
    """One cycle's tensors (name, bytes, dtype; in ready order) fused as Horovod's controller does
    (Controller::FuseResponses): a response takes the first tensor left, then the ones after it of its dtype while
    they fit the threshold; a tensor of another dtype is passed over (left for a later response) while the bytes
    fused and passed over still fit, and the first tensor beyond that ends the response."""
    left = list(tensors)
    responses = []
    while left:
        name, size, dtype = left.pop(0)
        fused, skipped, skipped_bytes = [name], [], 0.0
        while left and threshold_bytes > 0:
            other, nbytes, other_dtype = left[0]
            if other_dtype == dtype and size + nbytes <= threshold_bytes:
                fused.append(other)
                size += nbytes
                left.pop(0)
                continue
            skipped_bytes += nbytes
            if size + skipped_bytes > threshold_bytes:
                break
            skipped.append(left.pop(0))
        left = skipped + left
        responses.append(fused)
    return responses


def _horovod_modelled(model: JobModel, whatif: WhatIf) -> bool:
    """A Horovod what-if that models its communication (world size, bandwidth, latency): Horovod fuses the
    tensors into responses at run time, so they are priced as the responses its knobs as run would make, not as
    one collective per tensor (the measured layout; Daydream's baseline keeps one op per tensor by definition)."""
    return whatif.baseline != "daydream" and (
        (whatif.world_size is not None and whatif.world_size != model.world_size) or whatif.bandwidth_gbit is not None
        or whatif.bandwidth_scale != 1.0 or whatif.latency_us is not None)


def _refuse_rebucketing(model: JobModel, sharded: list[str], unmapped: list[str]) -> None:
    """Why the job's gradients cannot be grouped into other buckets, raised; nothing where they can."""
    if model.blocking_collectives:
        raise UnanswerableError(FSDP_RESTRUCTURED)
    compressed = [b.key for b in model.buckets if b.gathers_gradients]
    if compressed:
        raise UnanswerableError(f"re-bucketing: the script all-gathers its gradients compressed "
                                f"({', '.join(compressed[:3])}: each rank's share, top-k values or indices, between "
                                "the backward and the step); dprorun's buckets are all-reduces of whole gradients")
    if sharded:
        raise UnanswerableError(f"re-bucketing: the script reduce-scatters its gradients and gathers its parameters "
                                f"itself ({', '.join(sharded[:3])}: its optimizer sharded by hand); dprorun's buckets "
                                "are all-reduces")
    if not model.param_ready_fraction:
        raise UnanswerableError("re-bucketing needs per-parameter gradient-ready times, which this run lacks")
    if unmapped:
        raise UnanswerableError(f"re-bucketing: the script's own calls send buffers dprorun could not map to its "
                                f"parameters ({', '.join(unmapped[:3])}: no run of the gradients in model order adds "
                                "up to their bytes), so their parameters' gradients cannot be grouped otherwise")
    other = [b.key for b in model.buckets if b.key.startswith("ddp")]
    if other:  # parameter sizes are recorded for the first module; names repeat across modules ("0.weight")
        raise UnanswerableError(f"re-bucketing: the replayed buckets ({', '.join(other[:3])}) are a second DDP "
                                "module's, whose parameters dprorun does not tell apart from the first one's")


def plan_syncs(model: JobModel, whatif: WhatIf, notes: list[str]) -> tuple[list[Sync], bool]:
    """Bucket layout for the prediction; True when it is the measured one."""
    if model.framework == "horovod" and (whatif.horovod_fusion_mb is not None or whatif.horovod_cycle_ms is not None
                                         or _horovod_modelled(model, whatif)):
        threshold, cycle = model.horovod_knobs or horovod_knobs_as_run([])
        if whatif.horovod_fusion_mb is not None:
            threshold = whatif.horovod_fusion_mb * MB
        if whatif.horovod_cycle_ms is not None:
            cycle = whatif.horovod_cycle_ms * 1000.0
        responses = horovod_fusion(model, threshold, cycle)
        notes.append(f"Horovod fusion at {threshold / MB:g} MB, cycle {cycle / 1000:g} ms: {len(responses)} responses "
                     f"per step (cycles aligned with the start of backward; {model.horovod_negotiation_us:.0f} µs of "
                     "negotiation per cycle)")
        sparse, wire = model.sparse_gradients(), model.wire_ratio()

        def cost(param: str) -> float:  # a wire dtype's calibrated time over float32's (build._horovod_dtype_costs)
            return model.dtype_cost.get(model.wire_dtype(param), 1.0) if model.dtype_cost else 1.0

        return [Sync(f"bucket{k}", sparse[group[0]] if group[0] in sparse
                     else round(wire * cost(group[0]) * sum(model.param_bytes[p] for p in group)), fraction, None,
                     delay, sparse=group[0] in sparse)
                for k, (group, fraction, delay) in enumerate(responses)], False
    sharded = model.sharded_buckets()
    own = whatif.buckets == [list(b.params) for b in model.buckets]  # the optimizer's search starts from these
    unmapped = model.unmapped_buckets()
    if (whatif.buckets is None or ((sharded or unmapped) and own)) and whatif.bucket_mb is None:
        fractions = model.param_ready_fraction
        return [Sync(b.key, b.nbytes, max((fractions[p] for p in b.params if p in fractions), default=0.0),
                     b.transmit_us, sparse=b.sparse, grows_with_world=b.gathers_gradients,
                     after_update=b.collective == "all_gather" and not model.blocking_collectives
                     and not b.gathers_gradients)
                for b in model.buckets], True
    _refuse_rebucketing(model, sharded, unmapped)
    order = sorted(model.param_ready_fraction, key=model.param_ready_fraction.get)
    sparse, wire = model.sparse_gradients(), model.wire_ratio()
    if whatif.buckets is not None:
        groups = whatif.buckets
    elif model.framework == "tf":
        groups = tf_repacked(model, int(whatif.bucket_mb * MB))
        notes.append(f"{len(groups)} all-reduce packs for bytes_per_pack = {whatif.bucket_mb:g} MB, grouped in "
                     "the gradients' order as MultiWorkerMirroredStrategy does (a pack starts when its last "
                     "gradient is ready)")
    else:
        cap = int(whatif.bucket_mb * MB)
        dtypes = model.param_dtypes()
        groups = ddp_buckets(order, model.param_bytes, cap, sparse=sparse, dtypes=dtypes)
        kinds = f" (each of the gradients' dtypes, {', '.join(sorted(set(dtypes.values())))}, in buckets of its " \
            "own)" if dtypes else ""
        notes.append(f"{len(groups)} buckets of up to {whatif.bucket_mb:g} MB, grouped in gradient-ready order "
                     "as DDP's reducer does" + kinds + (" (each all-reduced as soon as its last gradient is ready, "
                                                        "inside the backward: the model wrapped in "
                                                        "DistributedDataParallel)"
                                                        if model.framework == "collectives" else ""))
    syncs = []
    for k, group in enumerate(groups):
        missing = [p for p in group if p not in model.param_ready_fraction or p not in model.param_bytes]
        if missing:
            raise UnanswerableError(f"bucket {k}: unknown parameters {missing[:3]}")
        alone = len(group) == 1 and group[0] in sparse
        nbytes = sparse[group[0]] if alone else round(wire * sum(model.param_bytes[p] for p in group))
        syncs.append(Sync(f"bucket{k}", nbytes, max(model.param_ready_fraction[p] for p in group), None,
                          sparse=alone))
    return syncs, False


def tf_packs(names: list[str], nbytes: dict[str, int], bytes_per_pack: int) -> list[list[str]]:
    """TensorFlow's packing of gradients for its collective all-reduce (CommunicationOptions bytes_per_pack):
    in the gradients' own order, a new pack opens once the current one holds more than bytes_per_pack
    (so packs err on the large side); 0 puts everything in one pack."""
    if bytes_per_pack <= 0:
        return [list(names)] if names else []
    packs: list[list[str]] = []
    size = 0
    for name in names:
        if not packs or size > bytes_per_pack:
            packs.append([])
            size = 0
        packs[-1].append(name)
        size += nbytes.get(name, 0)
    return packs


def tf_repacked(model: JobModel, bytes_per_pack: int) -> list[list[str]]:
    """The job's gradients in TensorFlow's packs of `bytes_per_pack`, each all-reduce call's apart (a step applying
    two optimizers all-reduces each one's gradients in a call, and packs of its own)."""
    call_of = {p: b.pack_call for b in model.buckets for p in b.params}
    groups: list[list[str]] = []
    for call in sorted(set(call_of.values())) or [0]:
        names = [n for n in model.param_bytes if call_of.get(n, 0) == call]
        groups += tf_packs(names, model.param_bytes, bytes_per_pack)
    return groups


def with_ready_groups(model: JobModel, whatif: WhatIf, notes: list[str]) -> JobModel:
    """The model with each compiled region's gradient-ready fraction set to the region's latest (a region's
    backward is one graph: its gradients appear when the graph finishes); the model itself without regions."""
    groups = whatif.ready_groups
    if not groups:
        return model
    notes.append("the script all-reduces its gradients after its backward: every bucket starts after all of it"
                 if model.framework == "collectives" and len(groups) == 1 else
                 "compiled model: its backward is one graph, so every bucket starts after all of it (no overlap "
                 "of communication with backward)" if len(groups) == 1 else
                 f"{len(groups)} compiled blocks: a block's gradients are ready at the end of its "
                 "backward graph (communication still overlaps the other blocks' backward)")
    fractions = dict(model.param_ready_fraction)
    for group in groups:
        known = [fractions[p] for p in group if p in fractions]
        if known:
            latest = max(known)
            for p in group:
                if p in fractions:
                    fractions[p] = latest
    return replace(model, param_ready_fraction=fractions)


def comm_scale(model: JobModel) -> float:
    """Measured / modelled transmission time over all the measured buckets (a ratio of totals, so large buckets
    weigh most): carries what the fit misses (contention, the backend's own overheads) into modelled what-ifs.
    A median of per-bucket ratios let a small bucket that rode the link's idle burst (tbf refills its 256 KB
    bucket during the forward pass) set the rate: the 0.25 MB what-if was 1.7 % faster than with totals.
    Horovod runs: 1 (their model is fitted on Horovod's own calls or its timeline, while the per-tensor records
    close in submission order and overstate them)."""
    if model.framework == "horovod" and model.comm.source.startswith("horovod"):
        return 1.0
    pairs = [(b.transmit_us, model.comm.allreduce_us(b.nbytes, model.ring_size)) for b in model.buckets
             if not b.sparse and not b.hook_work]  # a sparse gradient's gather is no ring all-reduce
    pairs = [(measured, modelled) for measured, modelled in pairs if measured > 0 and modelled > 0]
    return sum(m for m, _ in pairs) / sum(x for _, x in pairs) if pairs else 1.0


def hook_work_us_per_byte(model: JobModel) -> float:
    """A comm hook's own work on the gradients (PowerSGD's factorisation; trace.model.Bucket.hook_work), per byte
    it sends: what its buckets' measured time took beyond the modelled transmission of their bytes. What-ifs add
    it to the modelled transmission at their own network (it is compute, no network's), where the scale of
    `comm_scale` would have multiplied it with the link's change."""
    pairs = [(b.transmit_us - model.comm.allreduce_us(b.nbytes, model.ring_size), b.nbytes)
             for b in model.buckets if b.hook_work and b.transmit_us > 0]
    total_bytes = sum(n for _, n in pairs)
    return max(0.0, sum(w for w, _ in pairs)) / total_bytes if total_bytes else 0.0
