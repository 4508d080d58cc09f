"""Clock alignment across ranks (dPRO §4.2), solved with cvxpy.

Unknowns: one offset θ_r per rank (θ of the reference rank, normally 0, fixed at 0); adding θ_r to rank r's
timestamps puts them on the reference clock.

Evidence, all from the run directory:
  - clock probes: ping-pong rounds between rank 0 and each rank give  t0 - t1 <= θ_r <= t3 - t2  (hard);
  - point-to-point transfers (`--comm-detail ring`): a RECV cannot complete before its SEND started:
        recv_end + θ_recv >= send_start + θ_send                                     (hard);
  - whole collectives (bucket mode, per process group where a script's DDP has groups of its own; TensorFlow's
    collective ops by instance key): a collective cannot end on rank i before it started on rank j:
        end_i + θ_i >= start_j + θ_j  for every pair, written with one variable L_c per collective (its latest
        start on the reference clock):  start_j + θ_j <= L_c <= end_i + θ_i  for every rank, the same feasible
        offsets with 2N rows per collective instead of N(N-1)                        (hard);
  - RECV families (same tensor, step, chunk and sender across iterations): the RECV's duration, with its start
    clipped by its SEND's start, should be the same every iteration: minimise the variance within each family;
  - ranks on the same physical host share a clock: a penalty on their offset differences (the sum over a host's
    pairs, written as n times each rank's distance to a free host mean: linear in ranks);
  - the probe midpoints (the NTP estimate) as a prior.
The terms are weighted as a maximum-a-posteriori estimate: the family variances are divided by the pooled
within-family variance of RECV durations (σ_d², measured at the starting point), and each rank's prior by the
variance of a uniform error over its probe interval ((hi - lo)² / 12). The RECVs of one sender/receiver pair
share their errors (one link, one contention pattern; a late receiver finds small messages already buffered,
which biases the clipped durations), so each pair's rows together weigh as one observation. Measured on real
4-rank runs (benchmarks/RESULTS.md): counting every row separately let noisy families pull offsets 20-35 µs
off; with per-pair weighting the families refine loose probes and defer to tight ones.

The clipped duration  d = recv_end - max(recv_posted, send_start + θ_s - θ_r)  is concave in θ, so its variance
is not DCP. It is reformulated by fixing, for every RECV, which side of the max is active at the current
estimate: d becomes affine, the variance a convex quadratic (||(I - M)(A θ + b)||², M averaging each family),
and the branches are re-evaluated at the new solution until they stop changing (at most 6 rounds). Every
subproblem is a DCP-valid QP solved by CLARABEL (OSQP as second choice) under a time limit. If the hard
constraints contradict each other (noisy traces), they get non-negative slack with a large L1 penalty and the
result is marked approximate; if the solver fails, the probe midpoints (or the centre of the feasible interval)
are used, with a warning.

Uncertainty: every hard row is a difference constraint (x_u - x_v >= b), so the interval that the evidence
leaves for θ_r (θ_ref = 0, ranks on one host equal) is [-d(r, ref), d(ref, r)] with d the shortest path in the
constraint graph (edge u -> v of weight -b). The solution is a feasible potential, so the reduced weights are
non-negative and two Dijkstra runs give every rank's interval width. Where RECV families add evidence (ring
detail), the 95 % interval of the estimate (from the objective's curvature) is used when narrower. That is
`uncertainty_us`; a rank whose width exceeds 50 µs (or is unbounded) makes the alignment approximate, with a
warning.
"""
from __future__ import annotations

import importlib
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Optional

import numpy as np

from dprorun.trace.model import Op, OpKind, RunTrace, ddp_groups

TOLERANCE_US = 0.01
UNCERTAINTY_WARN_US = 50.0


@dataclass
class Alignment:
    offsets_us: dict[int, float]
    reference_rank: int
    method: str
    approximate: bool
    solve_time_s: float
    violations_before: int
    violations_after: int
    pairs_checked: int
    probe_intervals_us: dict[int, tuple[float, float]] = field(default_factory=dict)
    families: int = 0
    recv_duration_std_before_us: Optional[float] = None
    recv_duration_std_after_us: Optional[float] = None
    branch_rounds: int = 0
    warnings: list[str] = field(default_factory=list)
    # per rank: width of the interval the hard evidence leaves for its offset (inf: unbounded)
    uncertainty_us: dict[int, float] = field(default_factory=dict)
    constraint_rows: int = 0  # rows of the convex program (grows as ranks x collectives)

    def to_json(self) -> dict:
        out = asdict(self)
        out["offsets_us"] = {str(k): round(v, 3) for k, v in sorted(self.offsets_us.items())}
        out["probe_intervals_us"] = {str(k): [round(a, 3), round(b, 3)] for k, (a, b)
                                     in sorted(self.probe_intervals_us.items())}
        out["uncertainty_us"] = {str(k): (round(v, 3) if np.isfinite(v) else None)
                                 for k, v in sorted(self.uncertainty_us.items())}
        return out

    def max_uncertainty_us(self) -> Optional[float]:
        return max(self.uncertainty_us.values()) if self.uncertainty_us else None


@dataclass
class _Collectives:
    """Every whole collective seen on two or more ranks, as flat arrays (one row per rank and collective)."""
    index: np.ndarray  # collective number per row
    rank: np.ndarray
    start: np.ndarray  # relative to the collective's base
    end: np.ndarray
    base: np.ndarray  # per collective: its earliest start (raw clock), so the program's constants stay small

    @property
    def count(self) -> int:
        return len(self.base)

    def groups(self):
        """(rows of one collective) for each collective."""
        bounds = np.searchsorted(self.index, np.arange(self.count + 1))
        for c in range(self.count):
            yield slice(bounds[c], bounds[c + 1])


@dataclass
class _Evidence:
    ranks: list[int]
    lower: dict[tuple[int, int], float]  # point-to-point: (i, j): θ_i - θ_j >= value (tightest)
    p2p_checks: np.ndarray  # every individual transfer check, rows (i, j, b): violated if θ_i - θ_j < b
    collectives: _Collectives
    probes: dict[int, tuple[float, float]]
    recv_rows: list[tuple[int, int, float, float, float, tuple]]  # (sender, receiver, send_start, posted, end, fam)
    hosts: dict[int, str]

    @property
    def pair_checks(self) -> int:
        sizes = np.bincount(self.collectives.index, minlength=self.collectives.count)
        return len(self.p2p_checks) + int(np.sum(sizes * (sizes - 1)))

    def has_cross_rank_evidence(self) -> bool:
        return bool(self.probes or self.lower or self.collectives.count)


def _probe_intervals(run: RunTrace) -> dict[int, tuple[float, float]]:
    if 0 not in run.ranks:
        return {}
    origin: dict[tuple[int, int], tuple[float, float]] = {}
    for peer, k, role, a, b in run.ranks[0].clock.get("probes", []):
        if role == "origin":
            origin[(int(peer), int(k))] = (float(a), float(b))
    intervals = {}
    for rank, trace in run.ranks.items():
        if rank == 0:
            continue
        lo, hi = -np.inf, np.inf
        for peer, k, role, t1, t2 in trace.clock.get("probes", []):
            if role != "echo" or (rank, int(k)) not in origin:
                continue
            t0, t3 = origin[(rank, int(k))]
            lo, hi = max(lo, t0 - float(t1)), min(hi, t3 - float(t2))
        if np.isfinite(lo) and np.isfinite(hi):
            intervals[rank] = (lo, hi)
    return intervals


def _collect_collectives(spans: dict[tuple, dict[int, list[float]]]) -> _Collectives:
    index, rank, start, end, base = [], [], [], [], []
    for per_rank in spans.values():
        if len(per_rank) < 2:
            continue
        first = min(v[0] for v in per_rank.values())
        c = len(base)
        base.append(first)
        for r, (s, e) in sorted(per_rank.items()):
            index.append(c)
            rank.append(r)
            start.append(s - first)
            end.append(e - first)
    return _Collectives(np.array(index, dtype=np.int64), np.array(rank, dtype=np.int64),
                        np.array(start, dtype=float), np.array(end, dtype=float), np.array(base, dtype=float))


def collect_evidence(run: RunTrace) -> _Evidence:
    ranks = sorted(run.ranks)
    lower: dict[tuple[int, int], float] = {}
    checks: list[tuple[int, int, float]] = []
    sends: dict[str, Op] = {}
    recvs: dict[str, Op] = {}
    spans: dict[tuple, dict[int, list[float]]] = defaultdict(dict)
    # a script's own DDP groups run their buckets' all-reduces apart: one collective per group
    group_of = {rank: k for k, group in enumerate(ddp_groups(run)) for rank in group}
    for op in run.all_ops():
        if op.kind is not OpKind.COMM:
            continue
        if op.phase == "send" and op.txn_id:
            sends[op.txn_id] = op
        elif op.phase == "recv" and op.txn_id:
            recvs[op.txn_id] = op
        elif op.granularity == "collective" and op.phase == "transmit" and op.source in ("hooks", "xplane"):
            # DDP's and Horovod's per-bucket records; TensorFlow's collective ops (one instance key per launch)
            key = (op.tensor or op.txn_id, op.iteration, group_of.get(op.rank))
            seen = spans[key].get(op.rank)
            # a rank with two spans in one collective: its earliest start and latest end (weaker, never wrong)
            spans[key][op.rank] = ([op.start_us, op.end_us] if seen is None
                                   else [min(seen[0], op.start_us), max(seen[1], op.end_us)])
    recv_rows = []
    for txn, recv in recvs.items():
        send = sends.get(txn)
        if send is None or send.rank == recv.rank:
            continue
        # recv_end + θ_r >= send_start + θ_s   <=>   θ_r - θ_s >= send_start - recv_end
        value = send.start_us - recv.end_us
        checks.append((recv.rank, send.rank, value))
        if value > lower.get((recv.rank, send.rank), -np.inf):
            lower[(recv.rank, send.rank)] = value
        posted = float(recv.args.get("posted_us", recv.start_us))
        family = (recv.tensor, recv.step, recv.chunk, send.rank)
        recv_rows.append((send.rank, recv.rank, send.start_us, posted, recv.end_us, family))
    collectives = _collect_collectives(spans if not recv_rows else {})
    hosts = {r: run.ranks[r].host for r in ranks}
    return _Evidence(ranks, lower, np.array(checks, dtype=float).reshape(-1, 3), collectives,
                     _probe_intervals(run), recv_rows, hosts)


def count_violations(evidence: _Evidence, offsets: dict[int, float]) -> int:
    """Individual cross-rank checks the offsets violate: transfers, and every ordered pair of ranks in every
    collective (counted per collective in N log N from its sorted starts, not pair by pair)."""
    def theta(ranks: np.ndarray) -> np.ndarray:
        return np.array([offsets.get(int(r), 0.0) for r in ranks]) if len(ranks) else np.zeros(0)

    checks = evidence.p2p_checks
    count = 0
    if len(checks):
        count += int(np.sum(theta(checks[:, 0]) - theta(checks[:, 1]) < checks[:, 2] - TOLERANCE_US))
    coll = evidence.collectives
    if coll.count:
        shift = theta(coll.rank)
        starts, ends = coll.start + shift, coll.end + shift
        for rows in coll.groups():
            ordered = np.sort(starts[rows])
            # rank i violates against every j whose start is after i's end (never itself: start <= end)
            count += int(np.sum(len(ordered) - np.searchsorted(ordered, ends[rows] + TOLERANCE_US, side="right")))
    return count


def _initial_estimate(evidence: _Evidence, reference: int) -> dict[int, float]:
    lo_ref: dict[int, float] = defaultdict(lambda: -np.inf)  # θ_r - θ_ref >= lo
    hi_ref: dict[int, float] = defaultdict(lambda: np.inf)  # θ_r - θ_ref <= hi
    for (i, j), b in evidence.lower.items():
        if j == reference:
            lo_ref[i] = max(lo_ref[i], b)
        elif i == reference:
            hi_ref[j] = min(hi_ref[j], -b)
    coll = evidence.collectives
    for rows in coll.groups():
        members = coll.rank[rows]
        at = np.flatnonzero(members == reference)
        if not len(at):
            continue
        s_ref, e_ref = coll.start[rows][at[0]], coll.end[rows][at[0]]
        for r, s, e in zip(members, coll.start[rows], coll.end[rows]):
            if r != reference:  # end_r + θ_r >= start_ref + θ_ref ; end_ref + θ_ref >= start_r + θ_r
                lo_ref[int(r)] = max(lo_ref[int(r)], s_ref - e)
                hi_ref[int(r)] = min(hi_ref[int(r)], e_ref - s)
    estimate = {r: 0.0 for r in evidence.ranks}
    for rank in evidence.ranks:
        if rank == reference:
            continue
        if rank in evidence.probes:
            lo, hi = evidence.probes[rank]
            estimate[rank] = (lo + hi) / 2.0
            continue
        lo, hi = lo_ref[rank], hi_ref[rank]
        if np.isfinite(lo) and np.isfinite(hi):
            estimate[rank] = (lo + hi) / 2.0
        elif np.isfinite(lo):
            estimate[rank] = max(lo, 0.0)
        elif np.isfinite(hi):
            estimate[rank] = min(hi, 0.0)
    return estimate


@dataclass
class _HardRows:
    """Every hard constraint as  x_u - x_v >= b  over x = [θ (ranks), L (collectives)]."""
    u: np.ndarray
    v: np.ndarray
    b: np.ndarray
    variables: int

    def matrix(self):
        import scipy.sparse as sp

        m = len(self.b)
        rows = np.arange(m)
        return sp.csr_matrix((np.r_[np.ones(m), -np.ones(m)], (np.r_[rows, rows], np.r_[self.u, self.v])),
                             shape=(m, self.variables))


def _hard_rows(evidence: _Evidence, index: dict[int, int], reference: int) -> _HardRows:
    n = len(index)
    u, v, b = [], [], []
    for (i, j), value in evidence.lower.items():
        if i in index and j in index:
            u.append(index[i]), v.append(index[j]), b.append(value)
    for r, (lo, hi) in evidence.probes.items():
        if r in index:
            u += [index[r], index[reference]]
            v += [index[reference], index[r]]
            b += [lo, -hi]  # θ_r - θ_ref >= lo ; θ_ref - θ_r >= -hi
    coll = evidence.collectives
    u_arr, v_arr, b_arr = np.array(u, dtype=np.int64), np.array(v, dtype=np.int64), np.array(b, dtype=float)
    if coll.count:
        theta = np.array([index[int(r)] for r in coll.rank], dtype=np.int64)
        latest = n + coll.index
        # L_c - θ_j >= start_j  (every start before the latest start) ; θ_i - L_c >= -end_i  (every end after it)
        u_arr = np.r_[u_arr, latest, theta]
        v_arr = np.r_[v_arr, theta, latest]
        b_arr = np.r_[b_arr, coll.start, -coll.end]
    return _HardRows(u_arr, v_arr, b_arr, n + coll.count)


def uncertainty_widths(evidence: _Evidence, offsets: dict[int, float]) -> dict[int, float]:
    """Per rank, the width of the interval the hard evidence leaves for its offset (θ_ref = 0; ranks of one host
    share a clock): d(ref, r) + d(r, ref) in the difference-constraint graph, by two Dijkstra runs on weights
    made non-negative with the solution as potential (a violated row, soft solutions only, is clipped to 0)."""
    import scipy.sparse as sp
    from scipy.sparse.csgraph import dijkstra

    ranks = evidence.ranks
    reference = ranks[0]
    index = {r: k for k, r in enumerate(ranks)}
    rows = _hard_rows(evidence, index, reference)
    n = len(ranks)
    potential = np.zeros(rows.variables)
    potential[:n] = [offsets.get(r, 0.0) for r in ranks]
    coll = evidence.collectives
    if coll.count:  # L_c at the latest start the offsets give
        latest = np.full(coll.count, -np.inf)
        np.maximum.at(latest, coll.index, coll.start + potential[[index[int(r)] for r in coll.rank]])
        potential[n:] = latest
    # x_u - x_v >= b  <=>  x_v <= x_u - b : edge u -> v, weight -b
    src, dst, weight = list(rows.u), list(rows.v), list(-rows.b)
    first_on_host: dict[str, int] = {}
    for r in ranks:
        host = evidence.hosts.get(r)
        if host:
            k = first_on_host.setdefault(host, index[r])
            if k != index[r]:
                src += [k, index[r]]
                dst += [index[r], k]
                weight += [0.0, 0.0]
    if not src:
        return {r: (0.0 if r == reference else np.inf) for r in ranks}
    src_a, dst_a = np.array(src, dtype=np.int64), np.array(dst, dtype=np.int64)
    reduced = np.maximum(np.array(weight) + potential[src_a] - potential[dst_a], 0.0)
    key = src_a * rows.variables + dst_a
    order = np.lexsort((reduced, key))
    keep = order[np.r_[True, key[order][1:] != key[order][:-1]]]  # the tightest of parallel edges
    graph = sp.csr_matrix((reduced[keep] + 1e-9, (src_a[keep], dst_a[keep])),
                          shape=(rows.variables, rows.variables))
    ref = index[reference]
    forward = dijkstra(graph, directed=True, indices=ref)
    backward = dijkstra(graph.T.tocsr(), directed=True, indices=ref)
    return {r: (0.0 if r == reference else float(forward[index[r]] + backward[index[r]])) for r in ranks}


def _family_std(evidence: _Evidence, offsets: dict[int, float]) -> Optional[float]:
    groups: dict[tuple, list[float]] = defaultdict(list)
    for sender, receiver, send_start, posted, end, family in evidence.recv_rows:
        start = max(posted, send_start + offsets.get(sender, 0.0) - offsets.get(receiver, 0.0))
        groups[family].append(end - start)
    stds = [float(np.std(v)) for v in groups.values() if len(v) > 1]
    return float(np.mean(stds)) if stds else None


def align(run: RunTrace, time_limit_s: float = 10.0, host_weight: float = 100.0,
          prior_weight: float = 1e-3) -> Alignment:
    started = time.monotonic()
    evidence = collect_evidence(run)
    ranks = evidence.ranks
    reference = ranks[0]
    index = {r: k for k, r in enumerate(ranks)}
    zero = {r: 0.0 for r in ranks}
    estimate = _initial_estimate(evidence, reference)
    warnings: list[str] = []
    result = Alignment(offsets_us=dict(estimate), reference_rank=reference, method="none", approximate=True,
                       solve_time_s=0.0, violations_before=count_violations(evidence, zero), violations_after=0,
                       pairs_checked=evidence.pair_checks, probe_intervals_us=evidence.probes,
                       families=len({row[5] for row in evidence.recv_rows}),
                       recv_duration_std_before_us=_family_std(evidence, zero))
    if len(ranks) == 1:
        result.method, result.approximate = "single rank", False
        result.uncertainty_us = {reference: 0.0}
        return result
    clocks = {(run.ranks[r].host, str(run.ranks[r].clock.get("boot_id") or ""),
               float(run.ranks[r].clock.get("test_skew_us") or 0.0)) for r in ranks}
    if len(clocks) == 1 and all(next(iter(clocks))[:2]):
        # every rank read one machine's clock (one host, one boot: time.time_ns in every process): the offsets are
        # 0 by construction, not an estimate; nothing to solve (a solve would only add its noise, and 1-2 s a job)
        result.offsets_us = dict(zero)
        result.method, result.approximate = f"one clock: every rank on host {next(iter(clocks))[0]}", False
        result.uncertainty_us = dict(zero)
        result.violations_after = result.violations_before
        if result.violations_before:
            warnings.append(f"{result.violations_before} send/receive pairs read out of order on one clock: the "
                            "hooks' timestamps, not the clocks, are off there")
        result.warnings = warnings
        result.solve_time_s = round(time.monotonic() - started, 4)
        return result
    warnings += _missing_probe_warnings(run, evidence)  # one clock needs none (horovod.torch ranks record none)
    try:
        importlib.import_module("cvxpy")
    except Exception as exc:  # a broken or partial install must cost accuracy, never the analysis
        fallback = "probe midpoints" if evidence.probes else "the centre of the feasible intervals"
        warnings.append(f"cvxpy cannot be imported ({type(exc).__name__}: {exc}); falling back to {fallback}")
        return _finish(result, evidence, estimate, "fallback: " + ("probe midpoints" if evidence.probes
                                                                  else "interval centres"),
                       True, 0, warnings, started)
    program = _Program(evidence, index, reference, estimate, host_weight, prior_weight, time_limit_s)
    result.constraint_rows = len(program.rows.b)
    current = dict(estimate)
    soft = False
    method = "none"
    rounds = 0
    for rounds in range(1, 7):
        solution, method, status = program.solve(current, soft)
        if solution is None and not soft and status in ("infeasible", "infeasible_inaccurate"):
            warnings.append("the hard constraints contradict each other (noisy or inconsistent traces): "
                            "solved with penalised slack, offsets approximate")
            soft = True
            solution, method, status = program.solve(current, soft)
        if solution is None:
            warnings.append(f"cvxpy solve failed ({status}); falling back to "
                            + ("probe midpoints" if evidence.probes else "the centre of the feasible intervals"))
            method = "fallback: probe midpoints" if evidence.probes else "fallback: interval centres"
            current = dict(estimate)
            break
        moved = max(abs(solution[r] - current[r]) for r in ranks)
        current = solution
        if not evidence.recv_rows or moved < 0.01:
            break
        if time.monotonic() - started > time_limit_s:
            warnings.append("alignment time limit reached during branch refinement")
            break
    return _finish(result, evidence, current, method, soft, rounds, warnings, started, program)


def _missing_probe_warnings(run: RunTrace, evidence: _Evidence) -> list[str]:
    """Ranks without clock probes: say so, with the hooks' own reason where they recorded one."""
    missing = [r for r in evidence.ranks if r != 0 and r not in evidence.probes]
    if not missing or 0 not in run.ranks:
        return []
    reasons = sorted({w.splitlines()[0] for r in [0] + missing for w in run.ranks[r].warnings
                      if "end of the profiling window" in w or "clock probes failed" in w})
    return [f"no clock probes for rank(s) {missing}: their offsets rest on the traces alone"
            + (f" ({reasons[0]})" if reasons else "")]


class _Program:
    """The alignment's convex program: the hard rows as one sparse matrix, the objective's terms rebuilt per
    branch round (the RECV clip's active sides change), solved with CLARABEL (OSQP second)."""

    def __init__(self, evidence: _Evidence, index: dict[int, int], reference: int, estimate: dict[int, float],
                 host_weight: float, prior_weight: float, time_limit_s: float):
        import cvxpy as cp

        self.evidence, self.index, self.time_limit_s = evidence, index, time_limit_s
        ranks = evidence.ranks
        self.rows = _hard_rows(evidence, index, reference)
        self.x = cp.Variable(self.rows.variables)
        self.theta = self.x[: len(ranks)]
        self.hard = [self.theta[index[reference]] == 0]
        self.diff = self.rows.matrix() if len(self.rows.b) else None
        self.families = sorted({row[5] for row in evidence.recv_rows}, key=repr)
        self.family_index = {f: k for k, f in enumerate(self.families)}
        hosts: dict[str, list[int]] = defaultdict(list)
        for r in ranks:
            if evidence.hosts.get(r):
                hosts[evidence.hosts[r]].append(index[r])
        self.host_groups = [members for members in hosts.values() if len(members) > 1]
        self.host_mean = cp.Variable(len(self.host_groups)) if self.host_groups else None
        self.host_weight = host_weight
        self.prior = np.array([estimate[r] for r in ranks])
        self.prior_precision = np.array([
            1.0 / max((evidence.probes[r][1] - evidence.probes[r][0]) ** 2 / 12.0, 1.0) if r in evidence.probes
            else prior_weight for r in ranks])
        spread = _family_std(evidence, estimate)
        self.family_precision = 1.0 / max(spread or 1.0, 1.0) ** 2
        self.family_rows = None  # the RECV-family residual rows of the last round (for the posterior spread)

    def posterior_sd(self) -> Optional[np.ndarray]:
        """Per rank, the standard deviation of its offset estimate from the objective's curvature (a MAP
        estimate: the terms are precision-weighted squares, so the inverse of their Hessian over 2 is the
        covariance), with the reference fixed. Only where RECV families add evidence beyond the probes."""
        n = len(self.evidence.ranks)
        if self.family_rows is None or n > 2048:
            return None
        hessian = self.family_precision * (self.family_rows.T @ self.family_rows).toarray()
        hessian += np.diag(self.prior_precision)
        for members in self.host_groups:  # n w (I - 11ᵀ/n) on the host's ranks (its mean eliminated)
            k = len(members)
            block = self.host_weight * (k * np.eye(k) - np.ones((k, k)))
            hessian[np.ix_(members, members)] += block
        keep = [k for k in range(n) if k != self.index[self.evidence.ranks[0]]]
        try:
            covariance = np.linalg.inv(hessian[np.ix_(keep, keep)])
        except np.linalg.LinAlgError:
            return None
        sd = np.zeros(n)
        sd[keep] = np.sqrt(np.clip(np.diag(covariance), 0.0, None))
        return sd

    def objective(self, current: dict[int, float]):
        import cvxpy as cp
        import scipy.sparse as sp

        evidence, index, theta = self.evidence, self.index, self.theta
        n = len(evidence.ranks)
        terms = []
        if evidence.recv_rows:
            data, cols, rows_, consts, fam = [], [], [], [], []
            for k, (sender, receiver, send_start, posted, end, family) in enumerate(evidence.recv_rows):
                delta = current[sender] - current[receiver]
                fam.append(self.family_index[family])
                if send_start + delta > posted:  # send-bound: d = end - send_start - θ_s + θ_r
                    rows_ += [k, k]
                    cols += [index[sender], index[receiver]]
                    data += [-1.0, 1.0]
                    consts.append(end - send_start)
                else:  # receiver posted after the data was sent: d = end - posted
                    consts.append(end - posted)
            m = len(evidence.recv_rows)
            a_mat = sp.csr_matrix((data, (rows_, cols)), shape=(m, n))
            fam = np.array(fam)
            counts = np.bincount(fam, minlength=len(self.families)).astype(float)
            member = sp.csr_matrix((np.ones(m), (fam, np.arange(m))), shape=(len(self.families), m))
            mean_op = sp.diags(1.0 / counts[fam]) @ member.T @ member  # row k: mean of k's family
            centre = sp.identity(m, format="csr") - mean_op
            # errors within one rank pair are correlated (same link, same contention): the pair's rows count
            # as one observation, so a pair's families cannot outvote its probes by sheer number
            pair_rows: dict[tuple[int, int], int] = defaultdict(int)
            for row in evidence.recv_rows:
                pair_rows[(row[0], row[1])] += 1
            scale = sp.diags([np.sqrt(1.0 / pair_rows[(row[0], row[1])]) for row in evidence.recv_rows])
            r_mat = (scale @ centre @ a_mat).tocsr()
            c_vec = scale @ (centre @ np.array(consts))
            self.family_rows = r_mat
            terms.append(self.family_precision * cp.sum_squares(r_mat @ theta + c_vec))
        if self.host_groups:
            # Σ over a host's pairs (θ_a - θ_b)² = n Σ_a (θ_a - mean)² = n min_μ Σ_a (θ_a - μ)²
            members = np.concatenate(self.host_groups)
            group = np.concatenate([[g] * len(m) for g, m in enumerate(self.host_groups)])
            weight = np.sqrt(self.host_weight * np.array([len(self.host_groups[g]) for g in group], dtype=float))
            pick = sp.csr_matrix((np.ones(len(members)), (np.arange(len(members)), members)), shape=(len(members), n))
            mean = sp.csr_matrix((np.ones(len(members)), (np.arange(len(members)), group)),
                                 shape=(len(members), len(self.host_groups)))
            terms.append(cp.sum_squares(cp.multiply(weight, pick @ theta - mean @ self.host_mean)))
        terms.append(cp.sum_squares(cp.multiply(np.sqrt(self.prior_precision), theta - self.prior)))
        return cp.sum(cp.hstack(terms)) if len(terms) > 1 else terms[0]

    def solve(self, current: dict[int, float], soft: bool):
        import cvxpy as cp

        constraints = list(self.hard)
        penalty = 0
        if self.diff is not None:
            if soft:
                slack = cp.Variable(len(self.rows.b), nonneg=True)
                constraints.append(self.diff @ self.x + slack >= self.rows.b)
                penalty = 1e4 * cp.sum(slack)
            else:
                constraints.append(self.diff @ self.x >= self.rows.b)
        problem = cp.Problem(cp.Minimize(self.objective(current) + penalty), constraints)
        last_error = None
        for solver, opts in (("CLARABEL", {"time_limit": self.time_limit_s}),
                             ("OSQP", {"time_limit": self.time_limit_s, "eps_abs": 1e-7, "eps_rel": 1e-7})):
            if solver not in cp.installed_solvers():
                continue
            try:
                problem.solve(solver=solver, **opts)
            except cp.error.SolverError as exc:
                last_error = exc
                continue
            if problem.status in (cp.OPTIMAL, cp.OPTIMAL_INACCURATE) and self.x.value is not None:
                return ({r: float(self.x.value[self.index[r]]) for r in self.evidence.ranks}, f"cvxpy/{solver}",
                        problem.status)
            if problem.status in (cp.INFEASIBLE, cp.INFEASIBLE_INACCURATE):
                return None, solver, problem.status
            last_error = f"status {problem.status}"
        return None, "none", str(last_error)


def _finish(result: Alignment, evidence: _Evidence, offsets: dict[int, float], method: str, soft: bool,
            rounds: int, warnings: list[str], started: float, program: Optional[_Program] = None) -> Alignment:
    reference = result.reference_rank
    result.offsets_us = {r: offsets[r] - offsets[reference] for r in evidence.ranks}
    result.method = method
    result.approximate = soft or method.startswith("fallback") or method == "none"
    result.branch_rounds = rounds
    result.violations_after = count_violations(evidence, result.offsets_us)
    result.recv_duration_std_after_us = _family_std(evidence, result.offsets_us)
    if not evidence.has_cross_rank_evidence():
        warnings.append("no cross-rank evidence (no probes, transfers or collectives): offsets are 0")
        result.approximate = True
    result.uncertainty_us = uncertainty_widths(evidence, result.offsets_us)
    sd = program.posterior_sd() if program is not None and not soft and method.startswith("cvxpy") else None
    if sd is not None:  # the RECV families narrow it: the 95 % interval of the estimate, where narrower
        result.uncertainty_us = {r: min(w, 2 * 1.96 * float(sd[k])) for k, (r, w)
                                 in enumerate(result.uncertainty_us.items())}
    loose = {r: w for r, w in result.uncertainty_us.items() if not w <= UNCERTAINTY_WARN_US}
    if loose:
        worst = max(loose, key=lambda r: loose[r])
        width = "unbounded" if not np.isfinite(loose[worst]) else f"{loose[worst]:.0f} us wide"
        warnings.append(f"clock offsets uncertain: the evidence leaves rank {worst}'s offset an interval {width} "
                        f"({len(loose)} rank(s) above {UNCERTAINTY_WARN_US:.0f} us): cross-rank times are "
                        "approximate by that much")
        result.approximate = True
    result.solve_time_s = round(time.monotonic() - started, 4)
    result.warnings = warnings
    return result


def apply_alignment(run: RunTrace, alignment: Alignment) -> None:
    """Shift every rank's ops onto the reference clock and clip each RECV's start by its SEND's start."""
    for rank, trace in run.ranks.items():
        offset = alignment.offsets_us.get(rank, 0.0)
        trace.clock_offset_us = offset
        for op in trace.ops:
            op.start_us += offset
            op.end_us += offset
            if "posted_us" in op.args:
                op.args["posted_us"] = float(op.args["posted_us"]) + offset
        trace.iterations = [(i, s + offset, e + offset) for i, s, e in trace.iterations]
        trace.grad_ready = [(i, n, t + offset) for i, n, t in trace.grad_ready]
    sends = {op.txn_id: op for op in run.all_ops() if op.phase == "send" and op.txn_id}
    for op in run.all_ops():
        if op.phase == "recv" and op.txn_id in sends:
            op.start_us = min(op.end_us, max(op.start_us, sends[op.txn_id].start_us))
