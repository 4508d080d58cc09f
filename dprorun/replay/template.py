"""Per-rank iteration templates (measured from an aligned RunTrace by replay/measure.py), and the communication cost
model.

A template is one rank's iteration as the replayer needs it, averaged over the profiled iterations that ran
without torch.profiler (so the profiler's own overhead is not predicted):
  forward | loss (forward end -> backward start) | backward cut at every bucket's ready time (hook call) |
  update | tail (update end -> next iteration: data loading, Python)
plus, per bucket, its bytes, parameters and measured transmission time.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from dprorun.graph.local import OpProfile
from dprorun.stats import median
from dprorun.trace.model import OpKind, RunTrace


@dataclass
class RankTemplate:
    rank: int
    forward_us: float
    loss_us: float
    backward_segments_us: list[float]  # len(buckets) + 1, in ready order
    bucket_ready_order: list[str]  # bucket keys in the order they became ready
    update_us: float
    tail_us: float
    enqueue_cost_us: float  # main-thread cost of handing one bucket to the backend
    backward_us: float
    iterations_used: int
    measured_iteration_us: float
    finalize_us: float = 0.0  # DDP's finalize after the last bucket (copying results into .grad)
    accumulate_us: float = 0.0  # micro-batches before the forward (gradient accumulation, DDP's no_sync)
    gathered: list[str] = field(default_factory=list)  # a sharded step's parameter gathers after the update (keys)
    # blocking collectives (FSDP on the CPU) called in the forward, in call order, and the forward's compute cut at
    # them (len(forward_order) + 1 segments, summing to forward_us); the backward's are bucket_ready_order
    forward_order: list[str] = field(default_factory=list)
    forward_segments_us: list[float] = field(default_factory=list)


@dataclass
class BucketInfo:
    key: str
    nbytes: int
    params: list[str]
    transmit_us: float  # measured, averaged over ranks and iterations
    sparse: bool = False  # one sparse gradient: nbytes its indices and values, gathered from every rank
    wire_ratio: float = 1.0  # bytes sent / the gradients' bytes (a compressing comm hook: 0.5)
    hook_work: bool = False  # transmit_us is a comm hook's own work plus the transmission (trace.model.Bucket)
    # "all_reduce", or the script's "reduce_scatter" / "all_gather" (trace.model.Bucket.collective): nbytes is then
    # the all-reduce that sends the same bytes on the ring (half its own: ring_bytes), an all-gather runs after the
    # update
    collective: str = "all_reduce"
    dtype: str = ""  # its gradients' dtype (DDP buckets each dtype apart)
    gathers_gradients: bool = False  # compressed gradients all-gathered before the update (trace.model.Bucket)
    pack_call: int = 0  # the TensorFlow all-reduce call that packed it (trace.model.Bucket)


def ring_bytes(bucket) -> int:
    """The bytes of the all-reduce that sends what `bucket` (trace.model.Bucket) sends on a ring: its own, or half
    of a reduce-scatter's input or an all-gather's output (each rank sends (N-1)/N of them, an all-reduce 2(N-1)/N;
    the replay's ring then counts 2(N-1) messages for its N-1: (N-1) x the message latency over)."""
    return bucket.nbytes if bucket.collective == "all_reduce" else bucket.nbytes // 2


@dataclass
class CommModel:
    """Ring all-reduce cost: T(S, N) = c + 2(N-1) * (alpha + S / (N * bandwidth)); bandwidth in bytes/µs.

    alpha is the latency of one ring step (one message); c is a cost paid once per collective whatever the ring
    length (launching it, and on CPU jobs the time its threads lose to compute on the same cores). A fit at one
    world size only sees c + 2(N-1)·alpha; the split comes from the measured message latency (clock probes)."""

    alpha_us: float
    bandwidth_bytes_per_us: float
    source: str
    points: list[tuple[int, float]] = field(default_factory=list)
    collective_us: float = 0.0

    def allreduce_us(self, nbytes: float, world: int) -> float:
        if world <= 1:
            return 0.0
        return 2 * (world - 1) * self.step_us(nbytes, world)

    def step_us(self, nbytes: float, world: int) -> float:
        """One ring step's share of a collective (its per-collective cost spread over the steps)."""
        return self.step_latency_us(world) + nbytes / (world * self.bandwidth_bytes_per_us)

    def step_latency_us(self, world: int, alpha_us: Optional[float] = None) -> float:
        """The part of a ring step that is not bytes on the link: the per-collective cost spread over the
        2(N-1) steps plus one message's latency (`alpha_us` overrides the fitted one: a latency what-if)."""
        return self.collective_us / (2 * max(world - 1, 1)) + (self.alpha_us if alpha_us is None else alpha_us)

    def to_json(self) -> dict:
        return {"alpha_us": round(self.alpha_us, 3), "collective_us": round(self.collective_us, 3),
                "bandwidth_gbit_s": round(self.bandwidth_bytes_per_us * 8e-3, 4),
                "source": self.source, "points": len(self.points)}


@dataclass
class JobModel:
    world_size: int
    templates: dict[int, RankTemplate]
    buckets: list[BucketInfo]
    param_bytes: dict[str, int]
    param_ready_fraction: dict[str, float]  # within backward compute, 0..1, from gradient-ready times
    comm: CommModel
    bucket_cap_mb: Optional[float]
    channels: int = 1  # collectives the backend runs at once per rank
    samples: list["MeasuredIteration"] = field(default_factory=list)  # one per profiled iteration seen on every rank
    # the network alone: the start-of-window calibration (all-reduces with nothing else running); its bandwidth
    # prices the bytes a world-size change adds, while the trace's model keeps what the job itself adds
    network: Optional[CommModel] = None
    # rank 0's model timed eager / compiled / bf16 after the window (runtime/variants.py): variant -> timings
    compute_variants: dict[str, dict] = field(default_factory=dict)

    def compute_scales(self, variant: str) -> Optional[tuple[float, float]]:
        """(forward, backward) time of `variant` relative to eager, as measured; None if not measured."""
        eager, other = self.compute_variants.get("eager", {}), self.compute_variants.get(variant, {})
        try:
            return (other["forward_us"] / eager["forward_us"], other["backward_us"] / eager["backward_us"])
        except (KeyError, TypeError, ZeroDivisionError):
            return None

    @property
    def ring_size(self) -> int:
        """The ranks one of the job's DDP all-reduces spans (`ring_size`)."""
        return ring_size(self.ddp_groups, self.world_size)

    def ddp_groups_text(self) -> str:
        """The script's own DDP process groups as said in notes and errors: "[0, 1], [2, 3]"."""
        return ", ".join(str(group) for group in self.ddp_groups)

    def wire_ratio(self) -> float:
        """Bytes sent per byte of gradient, as the measured buckets were sent (a compressing comm hook: 0.5)."""
        ratios = [b.wire_ratio for b in self.buckets if not b.sparse]
        return float(np.median(ratios)) if ratios else 1.0

    def unmapped_buckets(self) -> list[str]:
        """The script's own calls (framework "collectives") that cannot be regrouped by parameter: those with a
        parameter of unknown bytes or ready time; and every one where the script sent buffers dprorun could not
        name (named after their calls: no run of the gradients added up to their bytes), since the gradients timed
        in the backward are then carried by no named bucket and their bytes are unknown. [] for a wrapper's
        buckets (DDP's, Horovod's: regrouped as the wrapper would)."""
        if self.framework != "collectives":
            return []
        if set(self.param_ready_fraction) - set(self.param_bytes):
            return [b.key for b in self.buckets]
        return [b.key for b in self.buckets
                if any(p not in self.param_bytes or p not in self.param_ready_fraction for p in b.params)]

    def sharded_buckets(self) -> list[str]:
        """The buckets the script reduce-scatters or all-gathers itself (its optimizer sharded by hand, ZeRO)."""
        return [b.key for b in self.buckets if b.collective != "all_reduce"]

    def param_dtypes(self) -> Optional[dict[str, str]]:
        """Each parameter's gradient dtype, read off the measured buckets, where they hold more than one (DDP keeps
        each dtype in buckets of its own); None where the job's gradients are of one dtype."""
        if len({b.dtype for b in self.buckets if not b.sparse}) < 2:
            return None
        return {p: b.dtype for b in self.buckets for p in b.params}

    def wire_dtype(self, param: str) -> str:
        """The dtype `param`'s gradient is sent in: its own, or float16 where the job compresses to half its bytes
        (hvd.Compression.fp16, fp16_compress_hook)."""
        dtype = next((b.dtype for b in self.buckets if param in b.params), "")
        return "float16" if dtype == "float32" and abs(self.wire_ratio() - 0.5) < 0.01 else dtype

    def sparse_gradients(self) -> dict[str, int]:
        """The parameters with sparse gradients (each its own bucket), with the bytes their bucket sent."""
        return {b.params[0]: b.nbytes for b in self.buckets if b.sparse and len(b.params) == 1}

    def fusion_blocks(self) -> list[str]:
        """The blocks rank 0 compiled one by one for the "compiled_blocks" variant ([] if not measured)."""
        return list(self.compute_variants.get("compiled_blocks", {}).get("blocks") or [])

    def block_param_groups(self, blocks: list[str]) -> list[list[str]]:
        """Each block's parameters (by name prefix), in the order of `blocks`; parameters outside every block
        are left out."""
        groups = []
        for block in blocks:
            prefix = block + "."
            groups.append([p for p in self.param_ready_fraction if p.startswith(prefix)])
        return [g for g in groups if g]

    notes: list[str] = field(default_factory=list)
    # whether a CPU transport takes its CPU from the computation (see transport_on_compute_cores); None: unknown
    transport: Optional[dict] = None
    # the run's own reference: per clean iteration (no profiling, nothing of dprorun's running), the median
    # over ranks of its duration; and per unprofiled window iteration likewise (what the replay is built from)
    clean_iterations_us: list[float] = field(default_factory=list)
    window_iterations_us: list[float] = field(default_factory=list)
    # the warm-up iterations before the window (from the third: the first ones set up), likewise: the job's speed
    # before any profiling, which tells a job still settling from the hooks' cost (predict._why_disagrees)
    warmup_iterations_us: list[float] = field(default_factory=list)
    framework: str = "ddp"  # "horovod": tensors fused at run time by Horovod's cycle/threshold; "tf": packs
    # the script's own DDP comm hook (its function's name, "" if none): it sends each bucket its own way, so a
    # bucket cannot be partitioned by dprorun's all-reduce (runtime/ddp.py registers no hook beside it)
    script_comm_hook: str = ""
    bucket_layout_fixed: str = ""  # why the job's bucket layout must stay as it ran ("" when it may change)
    script_calls_library: str = ""  # framework "collectives": whose calls the script shares its gradients with
    # the process groups the script's DDP all-reduces in where smaller than the world (trace.model.ddp_groups):
    # each group's buckets a ring of its own ranks (replay/comm.py); no world-size what-if (the script forms them)
    ddp_groups: list[list[int]] = field(default_factory=list)
    horovod_knobs: Optional[tuple[float, float]] = None  # as run: (fusion threshold bytes, cycle time µs)
    horovod_negotiation_us: float = 0.0  # per background-loop cycle: the ranks agreeing on what is ready
    # Horovod: a wire dtype's calibrated time over float32's for the same bytes (gloo sums float16 in software), its
    # responses' bytes scaled by it in the modelled what-ifs (replay/build._horovod_dtype_costs); {}: alike
    dtype_cost: dict[str, float] = field(default_factory=dict)
    # op level: per measured rank the profiled ops of each phase (graph/local.py), and per phase the ratio of its
    # unprofiled duration to its profiled one (median over ranks): how much the replay scaled the profiler's ops
    op_profiles: dict[int, OpProfile] = field(default_factory=dict)
    op_scaling: dict[str, float] = field(default_factory=dict)
    # TensorFlow: collectives in a step that all-reduce no gradient pack (a sparse gradient's all-gathers, Keras's
    # metric reductions), replayed inside the update as measured: (their names, median µs a step)
    collectives_outside_packs: tuple[list[str], float] = ([], 0.0)
    # DDP's buffer broadcast from its first rank before every training forward (broadcast_buffers): bytes, replayed
    # inside the forward as measured
    ddp_buffer_bytes: int = 0
    ddp_buffer_owners: list[str] = field(default_factory=list)  # the classes of the modules holding those buffers
    # FSDP on the CPU: every collective held its rank's thread (graph/local.blocking_collectives): the compute after
    # each waits for it (replay/local_dfg.py); its gathers are no ZeRO gathers after the update
    blocking_collectives: bool = False
    fsdp_subgroup_sizes: list[int] = field(default_factory=list)  # HSDP: FSDP's groups smaller than the job


@dataclass
class MeasuredIteration:
    """One measured iteration: every rank's template and each bucket's transmission time in it."""

    templates: dict[int, RankTemplate]
    transmit_us: dict[str, float]


def ring_size(ddp_groups: list[list[int]], world: int) -> int:
    """The ranks one DDP all-reduce spans: the world, or the size of the script's own process groups (the most
    common one where they differ)."""
    sizes = [len(group) for group in ddp_groups]
    return max(sorted(set(sizes)), key=sizes.count) if sizes else world


def fit_comm_model(points: list[tuple[int, float]], world: int, calibration: list[tuple[int, float]],
                   message_latency_us: Optional[float] = None) -> CommModel:
    """Least squares of T = a + b*S over measured (bytes, µs) points; a = c + 2(N-1)·alpha, b = 2(N-1)/(N·bw).
    With a measured one-message latency, alpha is that and the rest of a is the per-collective cost c; without
    one, all of a is per step (c = 0)."""
    steps = 2 * max(world - 1, 1)

    def split(a: float) -> tuple[float, float]:
        if message_latency_us is None or message_latency_us < 0:
            return a / steps, 0.0
        alpha = min(message_latency_us, a / steps)
        return alpha, a - steps * alpha

    def fit(data: list[tuple[int, float]]):
        sizes = np.array([p[0] for p in data], dtype=float)
        if len(data) < 2 or np.ptp(sizes) < 0.05 * max(sizes.max(), 1.0):
            return None
        slope, intercept = np.polyfit(sizes, np.array([p[1] for p in data], dtype=float), 1)
        if slope <= 0:
            return None
        return max(intercept, 0.0), slope

    for data, source in ((points, "trace"), (points + calibration, "trace+calibration"),
                         (calibration, "calibration")):
        fitted = fit(data)
        if fitted is not None:
            a, b = fitted
            alpha, collective = split(a)
            return CommModel(alpha_us=alpha, bandwidth_bytes_per_us=steps / (max(world, 2) * b),
                             source=source, points=data, collective_us=collective)
    if points:  # one size only: all of it bandwidth, no latency
        size, t = max(points)
        return CommModel(0.0, steps * size / (max(world, 2) * max(t, 1e-3)), "trace (one size: no latency term)",
                         points)
    return CommModel(50.0, 125.0, "default (nothing measured: 1 Gbit/s, 50 µs)", [])


def message_latency_us(run: RunTrace) -> Optional[float]:
    """One message's latency between ranks: half the median round trip of the clock probes (rank 0 pings every
    rank over the job's backend at the end of the window); None without probes."""
    if 0 not in run.ranks:
        return None
    trips = [b - a for _, _, role, a, b in run.ranks[0].clock.get("probes", []) if role == "origin" and b >= a]
    return float(np.median(trips)) / 2.0 if trips else None


TRANSPORT_CPU_SHARE = 0.3  # transport CPU per second of all-reduce above which the transport is CPU work


def transport_on_compute_cores(run) -> Optional[dict]:
    """Does communication take its CPU from the computation? True for a CPU transport (gloo on CPU tensors:
    the calibration's largest all-reduce keeps the transport's threads busy >= TRANSPORT_CPU_SHARE of its time)
    on ranks with no core to spare (cores per rank - torch's compute threads < 1). The replay gives
    communication devices of its own, so there it over-rates overlap and under-rates extra collectives.
    None when the run did not record it (older runs, Horovod without the DDP tracker)."""
    budgets, shares = [], []
    for trace in run.ranks.values():
        cpu = trace.meta.get("cpu") or {}
        if "spare_cores" in cpu:
            budgets.append(cpu)
        wall = {int(b): t for b, t in trace.meta.get("calibration", [])}
        rows = [(int(b), c) for b, c in trace.meta.get("calibration_transport_cpu", []) if wall.get(int(b), 0) > 0]
        if rows:  # the largest all-reduce: bytes dominate it, not the per-call costs every transport has
            nbytes, cpu_us = max(rows)
            shares.append(cpu_us / wall[nbytes])
    if not budgets or not shares:
        return None
    spare = min(float(b["spare_cores"]) for b in budgets)
    share = float(np.median(shares))
    on_gpu = any(t.get("backend") == "nccl" for tr in run.ranks.values() for t in tr.meta.get("trackers", []))
    shares_cores = (not on_gpu) and spare < 1.0 and share >= TRANSPORT_CPU_SHARE
    worst = min(budgets, key=lambda b: float(b["spare_cores"]))
    idle = {b: t for b, t in _rank_median_rows(run, "calibration")}
    beside = [[b, round(idle[b], 1), round(t, 1)] for b, t in _rank_median_rows(run, "calibration_under_compute")
              if b in idle]
    return {"shares_cores": shares_cores, "transport_cpu_share": round(share, 3), "spare_cores": spare,
            "cores_per_rank": worst.get("cores_per_rank"), "compute_threads": worst.get("compute_threads"),
            "local_ranks": worst.get("local_ranks"), "allreduce_idle_vs_beside_compute_us": beside}


def _rank_median_rows(run, key: str) -> list[list[float]]:
    """[[bytes, median µs over the ranks], ...] of a per-rank calibration table in trace meta."""
    by_size: dict[int, list[float]] = {}
    for trace in run.ranks.values():
        for row in trace.meta.get(key, []):
            by_size.setdefault(int(row[0]), []).append(float(row[1]))
    return [[b, median(v, 0.0)] for b, v in sorted(by_size.items())]


HOROVOD_DEFAULT_FUSION_BYTES = 128 * 1024 * 1024  # horovod 0.28 (common/operations.cc)
HOROVOD_DEFAULT_CYCLE_MS = 1.0


def horovod_knobs_as_run(args: list[str]) -> tuple[float, float]:
    """(fusion threshold bytes, cycle time µs) from the horovodrun arguments dprorun passed, else Horovod's
    defaults."""
    threshold, cycle = HOROVOD_DEFAULT_FUSION_BYTES, HOROVOD_DEFAULT_CYCLE_MS
    for flag, value in zip(args, args[1:]):
        if flag == "--fusion-threshold-mb":
            threshold = float(value) * 1024 * 1024
        elif flag == "--cycle-time-ms":
            cycle = float(value)
    return threshold, cycle * 1000.0


def _horovod_timeline_points(run: RunTrace) -> list[tuple[int, float]]:
    """(bytes, µs) of every fused response's transmission in the run's Horovod timeline (none if absent)."""
    timeline = run.horovod_timeline
    if timeline is None:
        return []
    groups: dict[tuple[int, str], list] = {}
    for op in timeline.trace.ops:
        if op.phase == "transmit" and op.iteration >= 1 and op.name.startswith(("GLOO_ALLREDUCE", "NCCL_ALLREDUCE")):
            groups.setdefault((op.iteration, op.txn_id), []).append(op)
    return [(sum(o.nbytes for o in ops), ops[0].dur_us) for ops in groups.values() if ops[0].dur_us > 0]


SMALL_CALL_BYTES = 1 << 16  # calibration calls this small are latency, not bandwidth


def horovod_comm_model(calibration: list, timeline_points: list, world: int,
                       cycle_us: float) -> Optional[tuple[CommModel, float]]:
    """Horovod's costs: (per-response model, negotiation per cycle µs). From the calibration (one
    `hvd.allreduce` per call, ranks lined up) when it fits a line, else from the timeline's fused responses.
    The bandwidth is the line's slope. A call's latency is read off the small calls (<= 64 KiB: their time
    less their bytes at that bandwidth, the lower of them; the line's intercept is set by the large calls and
    came out 0 on a 1 Gbit/s link where a 4 KiB call took 0.9 ms). It holds half a cycle on average (waiting
    for the background loop's next cycle, which the fusion replay puts in by itself: a response starts at the
    end of the cycle that picked it up), one negotiation round and one response's all-reduce; the two rounds
    are small-message collectives over the same transport and get half each."""
    if len(calibration) >= 2:
        fitted = fit_comm_model([tuple(p[:2]) for p in calibration], world, [])
        if fitted.source == "trace" and not _noise_over_bytes(calibration):
            steps = 2 * max(world - 1, 1)
            per_byte = steps / (max(world, 2) * fitted.bandwidth_bytes_per_us)
            small = [t - size * per_byte for size, t, *_ in calibration if size <= SMALL_CALL_BYTES]
            latency = min(small) if small else fitted.alpha_us * steps
            rounds = max(0.0, latency - cycle_us / 2)
            return (CommModel(rounds / 2 / steps, fitted.bandwidth_bytes_per_us,
                              "horovod calibration (one response per call)", fitted.points), rounds / 2)
        return _latency_bound_horovod_model(calibration, world, cycle_us)
    if timeline_points:
        fitted = fit_comm_model(timeline_points, world, [])
        if fitted.source == "trace":
            fitted.source = "horovod timeline (fused responses)"
            return fitted, 0.0
    return None


def _noise_over_bytes(calibration: list) -> bool:
    """Does the calibration's line explain less than its scatter: the fitted byte time of the largest call below
    the largest distance of a call from the line? (horovod.tensorflow's 4 KiB to 4 MiB calls, 12-23 ms in no order
    of size, fitted a slope worth 2.7 ms at 4 MiB with calls 6.4 ms off the line.)"""
    sizes = np.array([float(p[0]) for p in calibration])
    times = np.array([float(p[1]) for p in calibration])
    slope, intercept = np.polyfit(sizes, times, 1)
    return slope * sizes.max() < np.abs(times - (slope * sizes + intercept)).max()


LATENCY_BOUND = "horovod calibration (latency-bound: the calls' scatter hides their bytes; bandwidth a bound)"


def _latency_bound_horovod_model(calibration: list, world: int, cycle_us: float) -> tuple[CommModel, float]:
    """Horovod's costs from a calibration whose calls did not grow with their bytes (horovod.tensorflow's
    eager calls on a 2-core host: 12-23 ms each from 4 KiB to 4 MiB, in no order of size): every response costs
    the latency (the median call), and the bytes cost no more than the calls' spread shows: the largest call's
    time above the latency, at least the spread of the calls, all of it on its bytes (a bound on the bandwidth,
    not a measure of it)."""
    steps = 2 * max(world - 1, 1)
    times = [float(t) for _, t, *_ in calibration]
    latency = float(np.median(times))
    size, largest = max((int(s), float(t)) for s, t, *_ in calibration)
    byte_time = max(largest - latency, max(times) - min(times), 1.0)
    bandwidth = steps * size / (max(world, 2) * byte_time)
    rounds = max(0.0, latency - cycle_us / 2)
    points = [(int(s), float(t)) for s, t, *_ in calibration]
    return CommModel(rounds / 2 / steps, bandwidth, LATENCY_BOUND, points), rounds / 2


def comm_channels(run: RunTrace) -> int:
    """Collectives in flight at once: gloo's process group runs 2 worker threads, NCCL one stream, Horovod's
    background thread one response at a time, TensorFlow's step one pack at a time (MultiWorkerMirroredStrategy
    chains a step's collectives through its ordering token: a 256 KiB-pack step's second all-reduce started 0.2 ms
    after the first ended, the replay ran them side by side, 21 % short of the step)."""
    for trace in run.ranks.values():
        for tracker in trace.meta.get("trackers", []):
            if tracker.get("framework") == "tf":
                return 1
            if tracker.get("framework") == "collectives" and tracker.get("serial"):
                return 1  # the script's own all-reduces, each waited for before the next call (runtime/collectives.py)
            if tracker.get("backend") == "gloo":
                return 2
            if tracker.get("backend") in ("nccl", "horovod"):  # Horovod runs one response at a time
                return 1
    return 2 if run.manifest.get("backend_hint", "gloo") == "gloo" else 1


def _ready_fractions(run: RunTrace) -> dict[str, float]:
    """Each parameter's gradient-ready time as a fraction of backward compute (mean over ranks, iterations)."""
    values: dict[str, list[float]] = {}
    for trace in run.ranks.values():
        spans = {op.iteration: op for op in trace.ops if op.stream == "phase" and op.kind is OpKind.BW}
        for iteration, name, t in trace.grad_ready:
            bw = spans.get(iteration)
            if bw is None or bw.dur_us <= 0:
                continue
            values.setdefault(name, []).append(min(1.0, max(0.0, (t - bw.start_us) / bw.dur_us)))
    return {name: statistics.fmean(v) for name, v in values.items()}


def ddp_buckets(param_order: list[str], param_bytes: dict[str, int], cap_bytes: int,
                first_cap_bytes: Optional[int] = None, sparse=(),
                dtypes: Optional[dict[str, str]] = None) -> list[list[str]]:
    """Group parameters (in gradient-ready order) into buckets as DDP's reducer does: a bucket closes once its
    size reaches the cap (the first bucket's cap may be smaller); a parameter with a sparse gradient (in
    `sparse`) gets a bucket of its own; parameters of different dtypes (`dtypes`: a model with a bfloat16 trunk and
    a float32 head) never share a bucket: each dtype fills buckets of its own, with its own first cap. The buckets
    come in the order they closed, those still open at the end after them by their first parameter (torch's
    compute_bucket_assignment_by_size when DDP rebuilds its buckets in gradient-ready order)."""
    closed: list[list[str]] = []
    filling: dict[str, tuple[list[str], int, int]] = {}  # dtype -> (its open bucket, its bytes, its cap)
    first = first_cap_bytes if first_cap_bytes is not None else cap_bytes
    for name in param_order:
        if name in sparse:
            closed.append([name])
            continue
        key = (dtypes or {}).get(name, "")
        current, size, limit = filling.get(key, ([], 0, first))
        current.append(name)
        size += param_bytes.get(name, 0)
        if size >= limit:
            closed.append(current)
            current, size, limit = [], 0, cap_bytes
        filling[key] = (current, size, limit)
    position = {name: k for k, name in enumerate(param_order)}
    return closed + sorted((current for current, _, _ in filling.values() if current), key=lambda b: position[b[0]])
