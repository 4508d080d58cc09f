"""Clock alignment across ranks (dPRO §4.2), solved with cvxpy.

Unknowns: one offset θ_r per rank (θ of the reference rank, normally 0, fixed at 0); adding θ_r to rank r's
timestamps puts them on the reference clock.

Evidence, all from the run directory:
  - clock probes: ping-pong rounds between rank 0 and each rank give  t0 - t1 <= θ_r <= t3 - t2  (hard);
  - point-to-point transfers (`--comm-detail ring`): a RECV cannot complete before its SEND started:
        recv_end + θ_recv >= send_start + θ_send                                     (hard);
  - whole collectives (bucket mode): a collective cannot end on rank i before it started on rank j:
        end_i + θ_i >= start_j + θ_j                                                  (hard);
  - RECV families (same tensor, step, chunk and sender across iterations): the RECV's duration, with its start
    clipped by its SEND's start, should be the same every iteration: minimise the variance within each family;
  - ranks on the same physical host share a clock: a penalty on their offset differences;
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
"""
from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Optional

import numpy as np

from dprorun.trace.model import Op, OpKind, RunTrace

TOLERANCE_US = 0.01


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

    def to_json(self) -> dict:
        out = asdict(self)
        out["offsets_us"] = {str(k): round(v, 3) for k, v in sorted(self.offsets_us.items())}
        out["probe_intervals_us"] = {str(k): [round(a, 3), round(b, 3)] for k, (a, b)
                                     in sorted(self.probe_intervals_us.items())}
        return out


@dataclass
class _Evidence:
    ranks: list[int]
    lower: dict[tuple[int, int], float]  # (i, j): θ_i - θ_j >= value
    pair_checks: list[tuple[int, int, float]]  # every individual check (i, j, b): violated if θ_i - θ_j < b
    probes: dict[int, tuple[float, float]]
    recv_rows: list[tuple[int, int, float, float, float, tuple]]  # (sender, receiver, send_start, posted, end, fam)
    hosts: dict[int, str]


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


def collect_evidence(run: RunTrace) -> _Evidence:
    ranks = sorted(run.ranks)
    lower: dict[tuple[int, int], float] = {}
    checks: list[tuple[int, int, float]] = []

    def bound(i: int, j: int, value: float) -> None:
        checks.append((i, j, value))
        if value > lower.get((i, j), -np.inf):
            lower[(i, j)] = value

    sends: dict[str, Op] = {}
    recvs: dict[str, Op] = {}
    collectives: dict[tuple[str, int], list[Op]] = defaultdict(list)
    for op in run.all_ops():
        if op.kind is not OpKind.COMM:
            continue
        if op.phase == "send" and op.txn_id:
            sends[op.txn_id] = op
        elif op.phase == "recv" and op.txn_id:
            recvs[op.txn_id] = op
        elif op.granularity == "collective" and op.phase == "transmit" and op.source == "hooks":
            collectives[(op.tensor, op.iteration)].append(op)
    recv_rows = []
    for txn, recv in recvs.items():
        send = sends.get(txn)
        if send is None or send.rank == recv.rank:
            continue
        # recv_end + θ_r >= send_start + θ_s   <=>   θ_r - θ_s >= send_start - recv_end
        bound(recv.rank, send.rank, send.start_us - recv.end_us)
        posted = float(recv.args.get("posted_us", recv.start_us))
        family = (recv.tensor, recv.step, recv.chunk, send.rank)
        recv_rows.append((send.rank, recv.rank, send.start_us, posted, recv.end_us, family))
    if not recv_rows:
        for ops in collectives.values():
            for a in ops:
                for b in ops:
                    if a.rank != b.rank:
                        bound(a.rank, b.rank, b.start_us - a.end_us)  # end_a + θ_a >= start_b + θ_b
    hosts = {r: run.ranks[r].host for r in ranks}
    return _Evidence(ranks, lower, checks, _probe_intervals(run), recv_rows, hosts)


def count_violations(evidence: _Evidence, offsets: dict[int, float]) -> int:
    return sum(1 for i, j, b in evidence.pair_checks
               if offsets.get(i, 0.0) - offsets.get(j, 0.0) < b - TOLERANCE_US)


def _initial_estimate(evidence: _Evidence, reference: int) -> dict[int, float]:
    estimate = {r: 0.0 for r in evidence.ranks}
    for rank in evidence.ranks:
        if rank == reference:
            continue
        if rank in evidence.probes:
            lo, hi = evidence.probes[rank]
            estimate[rank] = (lo + hi) / 2.0
            continue
        lo = evidence.lower.get((rank, reference), -np.inf)
        hi_neg = evidence.lower.get((reference, rank), -np.inf)  # θ_ref - θ_r >= hi_neg -> θ_r <= -hi_neg
        hi = -hi_neg
        if np.isfinite(lo) and np.isfinite(hi):
            estimate[rank] = (lo + hi) / 2.0
        elif np.isfinite(lo):
            estimate[rank] = max(lo, 0.0)
        elif np.isfinite(hi):
            estimate[rank] = min(hi, 0.0)
    return estimate


def _family_std(evidence: _Evidence, offsets: dict[int, float]) -> Optional[float]:
    groups: dict[tuple, list[float]] = defaultdict(list)
    for sender, receiver, send_start, posted, end, family in evidence.recv_rows:
        start = max(posted, send_start + offsets.get(sender, 0.0) - offsets.get(receiver, 0.0))
        groups[family].append(end - start)
    stds = [float(np.std(v)) for v in groups.values() if len(v) > 1]
    return float(np.mean(stds)) if stds else None


def align(run: RunTrace, time_limit_s: float = 10.0, host_weight: float = 100.0,
          prior_weight: float = 1e-3) -> Alignment:
    import scipy.sparse as sp

    started = time.monotonic()
    evidence = collect_evidence(run)
    ranks = evidence.ranks
    reference = ranks[0]
    index = {r: k for k, r in enumerate(ranks)}
    n = len(ranks)
    zero = {r: 0.0 for r in ranks}
    before = count_violations(evidence, zero)
    estimate = _initial_estimate(evidence, reference)
    warnings: list[str] = []
    result = Alignment(offsets_us=dict(estimate), reference_rank=reference, method="none", approximate=True,
                       solve_time_s=0.0, violations_before=before, violations_after=0,
                       pairs_checked=len(evidence.pair_checks), probe_intervals_us=evidence.probes,
                       families=len({row[5] for row in evidence.recv_rows}),
                       recv_duration_std_before_us=_family_std(evidence, zero))
    if n == 1:
        result.method, result.approximate = "single rank", False
        return result
    try:
        import cvxpy as cp
    except Exception as exc:  # a broken or partial install must cost accuracy, never the analysis
        fallback = "probe midpoints" if evidence.probes else "the centre of the feasible intervals"
        warnings.append(f"cvxpy cannot be imported ({type(exc).__name__}: {exc}); falling back to {fallback}")
        return _finish(result, evidence, estimate, "fallback: " + ("probe midpoints" if evidence.probes
                                                                  else "interval centres"),
                       True, 0, warnings, started)

    theta = cp.Variable(n)
    hard = [theta[index[reference]] == 0]
    pairs = [(index[i], index[j], b) for (i, j), b in evidence.lower.items() if i in index and j in index]
    for r, (lo, hi) in evidence.probes.items():
        if r in index:
            pairs.append((index[r], index[reference], lo))  # θ_r - θ_ref >= lo
            pairs.append((index[reference], index[r], -hi))  # θ_ref - θ_r >= -hi
    if pairs:
        rows = np.arange(len(pairs))
        diff = sp.csr_matrix((np.r_[np.ones(len(pairs)), -np.ones(len(pairs))],
                              (np.r_[rows, rows], np.r_[[p[0] for p in pairs], [p[1] for p in pairs]])),
                             shape=(len(pairs), n))
        rhs = np.array([p[2] for p in pairs])
    families = sorted({row[5] for row in evidence.recv_rows}, key=repr)
    family_index = {f: k for k, f in enumerate(families)}
    same_host = [(index[a], index[b]) for a in ranks for b in ranks
                 if a < b and evidence.hosts.get(a) and evidence.hosts.get(a) == evidence.hosts.get(b)]
    prior = np.array([estimate[r] for r in ranks])
    prior_precision = np.array([
        1.0 / max((evidence.probes[r][1] - evidence.probes[r][0]) ** 2 / 12.0, 1.0) if r in evidence.probes
        else prior_weight for r in ranks])
    spread = _family_std(evidence, estimate)
    family_precision = 1.0 / max(spread or 1.0, 1.0) ** 2

    def objective_terms(current: dict[int, float]):
        terms = []
        if evidence.recv_rows:
            data, cols, rows_, consts, fam = [], [], [], [], []
            for k, (sender, receiver, send_start, posted, end, family) in enumerate(evidence.recv_rows):
                delta = current[sender] - current[receiver]
                fam.append(family_index[family])
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
            counts = np.bincount(fam, minlength=len(families)).astype(float)
            member = sp.csr_matrix((np.ones(m), (fam, np.arange(m))), shape=(len(families), m))
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
            terms.append(family_precision * cp.sum_squares(r_mat @ theta + c_vec))
        if same_host:
            terms.append(host_weight * cp.sum_squares(cp.hstack([theta[a] - theta[b] for a, b in same_host])))
        terms.append(cp.sum_squares(cp.multiply(np.sqrt(prior_precision), theta - prior)))
        return cp.sum(cp.hstack(terms)) if len(terms) > 1 else terms[0]

    def solve(current: dict[int, float], soft: bool):
        constraints = list(hard)
        penalty = 0
        if pairs:
            if soft:
                slack = cp.Variable(len(pairs), nonneg=True)
                constraints.append(diff @ theta + slack >= rhs)
                penalty = 1e4 * cp.sum(slack)
            else:
                constraints.append(diff @ theta >= rhs)
        problem = cp.Problem(cp.Minimize(objective_terms(current) + penalty), constraints)
        last_error = None
        for solver, opts in (("CLARABEL", {"time_limit": time_limit_s}), ("OSQP", {"time_limit": time_limit_s,
                                                                                  "eps_abs": 1e-7,
                                                                                  "eps_rel": 1e-7})):
            if solver not in cp.installed_solvers():
                continue
            try:
                problem.solve(solver=solver, **opts)
            except cp.error.SolverError as exc:
                last_error = exc
                continue
            if problem.status in (cp.OPTIMAL, cp.OPTIMAL_INACCURATE) and theta.value is not None:
                return {r: float(theta.value[index[r]]) for r in ranks}, f"cvxpy/{solver}", problem.status
            if problem.status in (cp.INFEASIBLE, cp.INFEASIBLE_INACCURATE):
                return None, solver, problem.status
            last_error = f"status {problem.status}"
        return None, "none", str(last_error)

    current = dict(estimate)
    soft = False
    method = "none"
    rounds = 0
    for rounds in range(1, 7):
        solution, method, status = solve(current, soft)
        if solution is None and not soft and status in ("infeasible", "infeasible_inaccurate"):
            warnings.append("the hard constraints contradict each other (noisy or inconsistent traces): "
                            "solved with penalised slack, offsets approximate")
            soft = True
            solution, method, status = solve(current, soft)
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
    return _finish(result, evidence, current, method, soft, rounds, warnings, started)


def _finish(result: Alignment, evidence: _Evidence, offsets: dict[int, float], method: str, soft: bool,
            rounds: int, warnings: list[str], started: float) -> Alignment:
    reference = result.reference_rank
    result.offsets_us = {r: offsets[r] - offsets[reference] for r in evidence.ranks}
    result.method = method
    result.approximate = soft or method.startswith("fallback") or method == "none"
    result.branch_rounds = rounds
    result.violations_after = count_violations(evidence, result.offsets_us)
    result.recv_duration_std_after_us = _family_std(evidence, result.offsets_us)
    result.solve_time_s = round(time.monotonic() - started, 4)
    if not evidence.probes and not evidence.lower:
        warnings.append("no cross-rank evidence (no probes, transfers or collectives): offsets are 0")
        result.approximate = True
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
