"""Strategy search along the critical path (dPRO's Algorithm 1, on the replay model of dprorun.replay).

1. Evaluate the job as it ran (its own bucket layout, replayed through the cost model so that every candidate
   is compared on the same footing).
2. Memory: when the estimated peak exceeds the budget, try re-computation and gradient accumulation and keep the
   fastest candidate under the budget (none fits: an error that says by how much).
3. Seeds: DDP's own bucketing at a grid of caps (cheap, and a good start for the local search).
4. Critical-path walk: replay, take the buckets whose synchronisation lies on the critical path, let every pass
   propose rewrites for them (tensor partition with k* from a partial replay; tensor fusion: merge with a
   neighbour or split; op fusion and bf16 where rank 0 measured them, first when computation dominates the
   path), replay each, keep the best; stop when no rewrite gains `min_gain`, or after `patience` rounds gaining
   less than 0.5 %.
Evaluations are cached by strategy; each is one replay of the median iteration (`replay_once`).
Speed-ups (dPRO's): the coarsened view is the job model itself (compute between bucket-ready points as one
segment, a bucket's tensors synchronised together), t_sync(s, k) is a partial replay of one tensor's ring
(`sync_time_us`), and from SYMMETRY_MIN_RANKS ranks on candidates are compared on a symmetric replay (identical
ranks: one built, the slowest measured rank standing for all; 1/N of the ops); the job as it ran and the chosen
strategy are then replayed in full.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Optional

from dprorun.optimize.passes import (CRITICAL_PATH_PASSES, Candidate, SearchContext, _with, compiled_variant,
                                     compute_scales, memory_candidates)
from dprorun.replay.template import JobModel, ddp_buckets
from dprorun.memory import peak_from_parts
from dprorun.replay.whatif import MB, WhatIf
from dprorun.replay.predict import replay_once, representative
from dprorun.strategy import Decision, Strategy, shared_transport
from dprorun.fsutil import UnanswerableError

DEFAULT_CAPS_MB = (0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 25.0, 50.0, 100.0)
SYMMETRY_MIN_RANKS = 4  # from this world size on, candidates are compared on a one-rank symmetric replay


class BudgetError(ValueError):
    """No strategy the memory passes know fits the memory budget."""


@dataclass
class MemoryModel:
    """Per-rank peak-memory parts (dprorun.memory rows); activations scale with the memory passes."""

    rows: list[dict]

    def peak_bytes(self, strategy: Strategy) -> Optional[int]:
        scale = 1.0 / max(1, strategy.accumulation_steps) / max(1, strategy.recompute_segments)
        peaks = []
        for row in self.rows:
            parts = row.get("parts") or {}
            if parts.get("at_ddp_init") is None:
                continue
            peaks.append(peak_from_parts(parts, scale))
        return max(peaks) if peaks else None


COMM_PASSES = ("tensor_fusion", "tensor_partition")  # the passes that change communication


def ready_order(model: JobModel) -> list[str]:
    return sorted(model.param_ready_fraction, key=model.param_ready_fraction.get)


def ddp_grouping(model: JobModel, cap_mb: float) -> list[list[str]]:
    """DDP's buckets for an explicit bucket_cap_mb (the first bucket gets the same cap; only DDP's default
    setting caps the first bucket at 1 MiB)."""
    cap = int(cap_mb * MB)
    return ddp_buckets(ready_order(model), model.param_bytes, cap, sparse=model.sparse_gradients(),
                       dtypes=model.param_dtypes())


def whatif_for(strategy: Strategy, model: Optional[JobModel] = None) -> WhatIf:
    forward_scale, backward_scale = compute_scales(model, strategy) if model is not None else (1.0, 1.0)
    compiled = compiled_variant(model, strategy) if model is not None else None
    return WhatIf(buckets=strategy.buckets, bucket_partitions=dict(strategy.partitions),
                  accumulation_steps=strategy.accumulation_steps, recompute_segments=strategy.recompute_segments,
                  forward_scale=forward_scale, backward_scale=backward_scale,
                  ready_groups=compiled_ready_groups(model, compiled, strategy.compiled_modules)
                  or after_the_backward(model))


def after_the_backward(model: Optional[JobModel]) -> Optional[list[list[str]]]:
    """A script that all-reduces its gradients itself (runtime/collectives.py) after its backward sends them then:
    every gradient ready together at its end, whatever the buckets. None for the others, and for a script that
    sends them from gradient hooks inside the backward (its measured buckets cut the backward)."""
    if model is None or model.framework != "collectives":
        return None
    if any(sum(t.backward_segments_us[1:]) > 0.05 * max(t.backward_us, 1.0) for t in model.templates.values()):
        return None
    return [list(model.param_ready_fraction)]


def compiled_ready_groups(model: JobModel, variant: Optional[str], modules: list[str]) -> Optional[list[list[str]]]:
    """The replay's ready groups for compiled regions: every parameter for the whole model, one group per
    block for compiled blocks, None when nothing measured is compiled."""
    if variant == "compiled":
        return [list(model.param_ready_fraction)]
    if variant == "compiled_blocks":
        return model.block_param_groups(modules)
    return None


def _critical_buckets(report: dict) -> tuple[list[str], bool]:
    """Buckets whose synchronisation is on the critical path (most time first), and whether communication
    outweighs computation there."""
    time_on: dict[str, float] = {}
    comm = compute = 0.0
    for row in report.get("path", []):
        parts = row["op"].split(".")
        if row["kind"] == "COMM":
            comm += row["time_on_path_ms"]
            key = next((p for p in parts if p.startswith("bucket")), None)
            if key:
                time_on[key] = time_on.get(key, 0.0) + row["time_on_path_ms"]
        elif row["kind"] != "VIRTUAL":
            compute += row["time_on_path_ms"]
        else:
            key = next((p for p in parts if p.startswith("bucket")), None)
            if key:
                time_on.setdefault(key, 0.0)
    return sorted(time_on, key=lambda k: -time_on[k]), comm > compute


def _key(strategy: Strategy) -> str:
    return json.dumps([strategy.buckets, sorted(strategy.partitions.items()), strategy.accumulation_steps,
                       strategy.recompute_segments, strategy.compiled_modules, strategy.precision])


def optimize(model: JobModel, memory: Optional[MemoryModel] = None, memory_budget_bytes: Optional[int] = None,
             caps_mb=DEFAULT_CAPS_MB, max_rounds: int = 40, patience: int = 5, min_gain: float = 0.002,
             time_limit_s: float = 120.0, allow_bf16: bool = False, comm_passes: Optional[bool] = None) -> Strategy:
    """The fastest strategy found for `model` (and under the memory budget when one is given). bf16 autocast
    changes the training's numerics, so it is only searched when `allow_bf16`; otherwise a measured bf16 gain
    is left as a recommendation in `strategy.search`. `comm_passes` (tensor fusion, tensor partition): None
    decides from the job: off where its CPU transport shares the cores the ranks compute on
    (`JobModel.transport`), whose cost the replay does not model (it would mostly propose smaller buckets for
    overlap that such a transport does not deliver).

    Phases: the memory passes when the estimated peak exceeds the budget; a seed among DDP's bucketings at
    `caps_mb`; rounds along the critical path (dPRO's order of passes); then the strategy is written up."""
    if model.blocking_collectives:
        raise UnanswerableError("FSDP on the CPU: dprorun's strategies (tensor fusion and partition, re-computation, "
                                "accumulation) would restructure the step around FSDP's own gathers and "
                                "reduce-scatters, which it does not model: nothing to search (world size, bandwidth "
                                "and compute what-ifs are answered: dpro replay RUN --np N / --bandwidth B)")
    if not model.param_ready_fraction:
        raise UnanswerableError("the optimizer needs per-parameter gradient-ready times (profile without "
                                "--no-param-hooks)")
    search = _Search(model, min_gain, allow_bf16, comm_passes)
    current = search.start()
    current = search.within_budget(current, memory, memory_budget_bytes)
    current = search.seed(current, caps_mb)
    current, rounds = search.along_critical_path(current, max_rounds, patience, time_limit_s)
    return search.written_up(current, memory, memory_budget_bytes, caps_mb, rounds)


class _Search:
    """One search's state: the replay cache, the decisions taken, the symmetric-replay switch."""

    def __init__(self, model: JobModel, min_gain: float, allow_bf16: bool, comm_passes: Optional[bool]):
        self.model = model
        self.min_gain = min_gain
        self.allow_bf16 = allow_bf16
        self.started = time.monotonic()
        self.cache: dict[str, tuple[float, dict]] = {}
        self.decisions: list[Decision] = []
        # symmetry (identical ranks): at larger world sizes every candidate is replayed with one rank standing
        # for all, 1/N of the ops; the baseline and the result are replayed in full
        self.symmetric = model.world_size >= SYMMETRY_MIN_RANKS
        self.search_model = representative(model) if self.symmetric else model
        self.shares_cores = bool(model.transport and model.transport.get("shares_cores"))
        self.comm_passes = (not self.shares_cores) if comm_passes is None else comm_passes
        if model.bucket_layout_fixed:  # not even when forced: the job would not run
            self.comm_passes = False
        self.measured: list[list[str]] = []
        self.baseline_us = 0.0

    def evaluate(self, strategy: Strategy) -> tuple[float, dict]:
        key = _key(strategy)
        if key not in self.cache:
            self.cache[key] = replay_once(self.search_model, whatif_for(strategy, self.model))
        return self.cache[key]

    def evaluate_full(self, strategy: Strategy) -> float:
        if self.symmetric:
            return replay_once(self.model, whatif_for(strategy, self.model))[0]
        return self.evaluate(strategy)[0]

    def accept(self, candidate: Candidate, before_us: float, after_us: float, note: str = "") -> Strategy:
        self.decisions.append(Decision(candidate.pass_name, candidate.choice, round(before_us / 1000, 4),
                                       round(after_us / 1000, 4), note))
        return candidate.strategy

    def start(self) -> Strategy:
        """The job's own layout (DDP's grouping at its cap where the measured buckets are not all known)."""
        known = set(self.model.param_ready_fraction)
        measured = [list(b.params) for b in self.model.buckets]
        if not measured or (any(p not in known for g in measured for p in g) and not self.model.sharded_buckets()
                            and not self.model.unmapped_buckets()):  # a script's buffers not mapped: its own calls
            measured = ddp_grouping(self.model, self.model.bucket_cap_mb or 25.0)
        self.measured = measured
        current = Strategy(buckets=measured)
        self.baseline_us = self.evaluate_full(current)
        return current

    def within_budget(self, current: Strategy, memory: Optional[MemoryModel],
                      budget: Optional[int]) -> Strategy:
        """Over the memory budget: the fastest memory pass (re-computation, accumulation) that fits."""
        peak = memory.peak_bytes(current) if memory else None
        if budget is None or peak is None or peak <= budget:
            return current
        options = []
        for cand in memory_candidates(current):
            cand_peak = memory.peak_bytes(cand.strategy)
            if cand_peak is not None and cand_peak <= budget:
                options.append((self.evaluate(cand.strategy)[0], cand_peak, cand))
        if not options:
            smallest = min(memory.peak_bytes(c.strategy) or 0 for c in memory_candidates(current))
            raise BudgetError(f"estimated peak {peak / 2**20:.1f} MiB exceeds the budget {budget / 2**20:.1f} MiB, "
                              f"and the best the memory passes reach is {smallest / 2**20:.1f} MiB")
        t, cand_peak, cand = min(options, key=lambda o: o[0])
        return self.accept(cand, self.evaluate(current)[0], t,
                           f"peak {peak / 2**20:.1f} -> {cand_peak / 2**20:.1f} MiB, budget {budget / 2**20:.1f} MiB")

    def seed(self, current: Strategy, caps_mb) -> Strategy:
        """The best of DDP's own bucketings at `caps_mb`, if it beats the current layout."""
        best_t, _ = self.evaluate(current)
        seed_best = None
        for cap in caps_mb if self.comm_passes else ():
            cand = Candidate("tensor_fusion", "", _with(current, buckets=ddp_grouping(self.model, cap), partitions={}))
            t, _ = self.evaluate(cand.strategy)
            if t < best_t * (1 - self.min_gain):
                best_t, seed_best = t, (cap, cand)
        if seed_best is None:
            return current
        cap, cand = seed_best
        cand.choice = f"DDP bucketing at {cap:g} MB ({len(cand.strategy.buckets)} buckets)"
        return self.accept(cand, self.evaluate(current)[0], best_t)

    def along_critical_path(self, current: Strategy, max_rounds: int, patience: int,
                            time_limit_s: float) -> tuple[Strategy, int]:
        """Rounds: the passes for the critical buckets (communication-bound: partition and tensor fusion first;
        computation-bound: op fusion first), the best candidate taken while it gains `min_gain`."""
        rounds = stale = 0
        for rounds in range(1, max_rounds + 1):
            t, report = self.evaluate(current)
            critical, comm_bound = _critical_buckets(report)
            if time.monotonic() - self.started > time_limit_s:
                break
            ctx = SearchContext(self.model, current, critical, comm_bound)
            order = ("tensor_partition", "tensor_fusion", "op_fusion", "mixed_precision") if comm_bound else \
                ("op_fusion", "mixed_precision", "tensor_fusion", "tensor_partition")
            scored = [(self.evaluate(c.strategy)[0], c) for name in order
                      if self.allow_bf16 or name != "mixed_precision"
                      if self.comm_passes or name not in COMM_PASSES for c in CRITICAL_PATH_PASSES[name](ctx)]
            if not scored:
                break
            new_t, cand = min(scored, key=lambda s: s[0])
            if new_t >= t * (1 - self.min_gain):
                break
            current = self.accept(cand, t, new_t, "communication-bound" if comm_bound else "computation-bound")
            stale = stale + 1 if new_t > t * (1 - 0.005) else 0
            if stale >= patience:
                break
        return current, rounds

    def script_all_reduces_recommended(self, final_t: float) -> list[str]:
        """Gradients all-reduced by the script's own calls (runtime/collectives.py), which dprorun cannot change:
        what fusing them into one call, or wrapping the model in DistributedDataParallel (its default buckets: 1 MiB
        for the first, 25 MB after; each sent as soon as its gradients are ready in the backward), would give, where
        either is 5 % faster."""
        model = self.model
        if model.framework != "collectives" or model.sharded_buckets():  # ZeRO by hand: no all-reduce to fuse
            return []
        if model.unmapped_buckets():  # their gradients cannot be regrouped: the what-ifs say why
            return []
        said = []
        ddp_default = ddp_buckets(ready_order(model), model.param_bytes, 25 * MB, MB, model.sparse_gradients(),
                                  model.param_dtypes())
        ways = [(ddp_default, f"wrapping the model in DistributedDataParallel (its default buckets, {len(ddp_default)} "
                              "here, each all-reduced as soon as its gradients are ready in the backward)")]
        if len(self.measured) > 1:
            ways.append(([ready_order(model)], f"one all-reduce of all the gradients (a flat buffer) in place of "
                                               f"the script's {len(self.measured)}"))
        for buckets, what in ways:
            ready = None if buckets is ddp_default else buckets  # one flat buffer: after the backward
            t, _ = replay_once(self.search_model, WhatIf(buckets=buckets, ready_groups=ready))
            if t < final_t * 0.95:
                said.append(f"{what} would predict {t / 1000:.2f} ms (-{100 * (1 - t / final_t):.0f} %); a change "
                            "of the script's")
        return said

    def written_up(self, current: Strategy, memory: Optional[MemoryModel], budget: Optional[int], caps_mb,
                   rounds: int) -> Strategy:
        """The strategy with its predictions, decisions, recommendations and the search's own record."""
        model = self.model
        final_t, _ = self.evaluate(current)
        final_full = self.evaluate_full(current)
        recommendations = []
        if not self.allow_bf16:
            for cand in CRITICAL_PATH_PASSES["mixed_precision"](SearchContext(model, current, [], False)):
                t, _ = self.evaluate(cand.strategy)
                if t < final_t * 0.95:
                    recommendations.append(f"{cand.choice} would predict {t / 1000:.2f} ms (-"
                                           f"{100 * (1 - t / final_t):.0f} %); it changes the training's numerics: "
                                           "allow it with --allow-bf16")
        recommendations += self.script_all_reduces_recommended(final_t)
        if current.buckets == self.measured:
            current = _with(current, buckets=None)  # the job's own layout
        else:
            for cap in caps_mb:  # realisable by DDP's own bucket cap: applied without a comm hook
                if current.buckets == ddp_grouping(model, cap):
                    current = _with(current, bucket_cap_mb=cap)
                    break
        current.baseline_ms = round(self.baseline_us / 1000, 4)
        current.predicted_ms = round(final_full / 1000, 4)
        current.predicted_peak_bytes = memory.peak_bytes(current) if memory else None
        current.memory_budget_bytes = budget
        current.decisions = self.decisions
        current.search = {"evaluations": len(self.cache), "rounds": rounds,
                          "seconds": round(time.monotonic() - self.started, 3), "world_size": model.world_size,
                          "symmetric_replays": self.symmetric, "buckets_before": len(self.measured),
                          "buckets_after": len(current.buckets) if current.buckets else len(self.measured)}
        if recommendations:
            current.search["recommendations"] = recommendations
        if not self.comm_passes:
            current.search["comm_passes"] = (
                f"off: {shared_transport(model.transport)}, where more collectives "
                "cost more and overlap gains less than the replay predicts; bucket layout and partitions left as "
                "they are (`dpro optimize --comm-passes on` forces them)" if self.shares_cores and
                not model.bucket_layout_fixed else f"off: {model.bucket_layout_fixed}" if model.bucket_layout_fixed
                else "off (asked)")
        if model.script_comm_hook and self.comm_passes:
            current.search["partitions"] = (f"off: the script's own comm hook ({model.script_comm_hook}) sends the "
                                            "buckets, so dprorun cannot split their all-reduces")
        failed = [v["error"] for v in model.compute_variants.values() if "error" in v]
        if failed and len(failed) == len(model.compute_variants):  # asked for, none measured: say why
            current.search["compute_passes"] = f"off: no compute variant could be measured ({failed[0]})"
        if self.symmetric and final_full > self.baseline_us:
            current.search["warning"] = (f"the symmetric search's choice replays slower in full "
                                         f"({final_full / 1000:.2f} vs {self.baseline_us / 1000:.2f} ms): the ranks "
                                         "differ more than symmetry assumes")
        return current
