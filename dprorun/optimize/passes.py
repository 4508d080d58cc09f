"""Graph passes of the optimizer. Each pass proposes rewrites of the current strategy (which the replayer turns
into a new global DFG) and knows how it becomes a real setting on restart (dprorun/runtime/apply.py).

  tensor_fusion    regroup gradients into buckets: merge a critical bucket with its neighbour in ready order,
                   or split it where its bytes halve (any grouping, not only DDP's size cap)
  tensor_partition split a critical bucket's all-reduce into k pieces, k from a partial replay of its
                   synchronisation alone (t_sync(s, k), dPRO's k*)
  recompute        activation checkpointing in s segments: backward repeats (s-1)/s of the forward, activations
                   kept / s (memory pass)
  accumulation     k micro-batches per step: activations / k, one synchronisation per k micro-batches (memory
                   pass; needs the script: printed and readable through dprorun.strategy())
  op_fusion        torch.compile of a region: the whole model (one backward graph: every gradient ready at its
                   end, no overlap with communication) or each of the model's blocks separately (a backward graph
                   per block: its gradients ready at the block's end, communication still overlaps); the
                   replay's forward and backward scaled by the compiled/eager ratios rank 0 measured on the job's
                   own model and batch (runtime/variants.py); offered only where that measurement exists
  mixed_precision  bf16 autocast of the forward, scaled the same way by its measured ratios (gradients and their
                   all-reduce stay fp32, so communication is unchanged)
Both interact with the others through the replay: a faster backward can expose communication that was hidden.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

from dprorun.replay.template import JobModel
from dprorun.replay.predict import sync_time_us
from dprorun.strategy import Strategy


@dataclass
class Candidate:
    pass_name: str
    choice: str
    strategy: Strategy


@dataclass
class SearchContext:
    """What the passes see: the job model, the current strategy, and the buckets on the critical path (most
    time on it first)."""

    model: JobModel
    strategy: Strategy
    critical_buckets: list[str]
    comm_bound: bool


def _with(strategy: Strategy, **changes) -> Strategy:
    return dataclasses.replace(strategy, decisions=list(strategy.decisions), **changes)


def _index(key: str) -> int:
    return int(key.replace("bucket", ""))


def _renumber_partitions(parts: dict[str, int], mapping: Callable[[int], list[int]]) -> dict[str, int]:
    """Partition counts follow their bucket when bucket indices shift (merged buckets keep the larger k)."""
    out: dict[str, int] = {}
    for key, k in parts.items():
        for new in mapping(_index(key)):
            out[f"bucket{new}"] = max(out.get(f"bucket{new}", 1), k)
    return {key: k for key, k in out.items() if k > 1}


def tensor_fusion(ctx: SearchContext) -> Iterable[Candidate]:
    groups = ctx.strategy.buckets or []
    sizes = [sum(ctx.model.param_bytes[p] for p in g) for g in groups]
    sparse = ctx.model.sparse_gradients()  # DDP keeps each sparse gradient in a bucket of its own
    for key in ctx.critical_buckets[:3]:
        i = _index(key)
        if i >= len(groups):
            continue
        for j in (i - 1, i):  # merge bucket j with j+1 (saves one synchronisation's latency)
            if 0 <= j < len(groups) - 1 and not any(p in sparse for p in groups[j] + groups[j + 1]):
                merged = groups[:j] + [groups[j] + groups[j + 1]] + groups[j + 2:]
                parts = _renumber_partitions(ctx.strategy.partitions,
                                             lambda b, j=j: [b if b <= j else b - 1])
                yield Candidate("tensor_fusion", f"merge bucket{j} and bucket{j + 1} "
                                f"({(sizes[j] + sizes[j + 1]) / 2**20:.2f} MB)",
                                _with(ctx.strategy, buckets=merged, partitions=parts))
        if len(groups[i]) > 1:  # split where the bytes halve (starts its synchronisation earlier)
            running, cut = 0, 1
            for cut, name in enumerate(groups[i], start=1):
                running += ctx.model.param_bytes[name]
                if running >= sizes[i] / 2:
                    break
            cut = min(max(cut, 1), len(groups[i]) - 1)
            split = groups[:i] + [groups[i][:cut], groups[i][cut:]] + groups[i + 1:]
            parts = _renumber_partitions(ctx.strategy.partitions,
                                         lambda b, i=i: [b] if b < i else [b, b + 1] if b == i else [b + 1])
            yield Candidate("tensor_fusion", f"split bucket{i} ({sizes[i] / 2**20:.2f} MB) after {cut} tensors",
                            _with(ctx.strategy, buckets=split, partitions=parts))


def best_partitions(model: JobModel, nbytes: int, choices=(1, 2, 4, 8)) -> tuple[int, dict[int, float]]:
    """k* for one tensor: the piece count whose synchronisation alone replays fastest (partial replay)."""
    times = {k: sync_time_us(model, nbytes, partitions=k) for k in choices}
    return min(times, key=times.get), times


def tensor_partition(ctx: SearchContext) -> Iterable[Candidate]:
    if ctx.model.script_comm_hook:  # the script's hook sends the buckets: dprorun's partitioned all-reduce cannot
        return
    groups = ctx.strategy.buckets or []
    sparse = ctx.model.sparse_gradients()
    for key in ctx.critical_buckets[:2]:
        i = _index(key)
        if i >= len(groups):
            continue
        if any(p in sparse for p in groups[i]):
            continue  # a sparse gradient is sent as gathered indices and values, in one piece
        nbytes = sum(ctx.model.param_bytes[p] for p in groups[i])
        k_star, _ = best_partitions(ctx.model, nbytes)
        current = ctx.strategy.partitions.get(key, 1)
        for k in sorted({k_star, current * 2}):
            if k != current and 1 <= k <= 16:
                parts = dict(ctx.strategy.partitions)
                parts[key] = k
                if k == 1:
                    parts.pop(key)
                yield Candidate("tensor_partition", f"all-reduce {key} in {k} pieces",
                                _with(ctx.strategy, partitions=parts))


def op_fusion(ctx: SearchContext) -> Iterable[Candidate]:
    if "" not in ctx.strategy.compiled_modules and ctx.model.compute_scales("compiled") is not None:
        fs, bs = ctx.model.compute_scales("compiled")
        yield Candidate("op_fusion", f"torch.compile the model (measured forward x{fs:.2f}, backward x{bs:.2f})",
                        _with(ctx.strategy, compiled_modules=[""]))
    blocks = ctx.model.fusion_blocks()
    if blocks and ctx.strategy.compiled_modules != blocks and ctx.model.compute_scales("compiled_blocks") is not None:
        fs, bs = ctx.model.compute_scales("compiled_blocks")
        yield Candidate("op_fusion", f"torch.compile each of the {len(blocks)} blocks ({blocks[0]}, ...; measured "
                        f"forward x{fs:.2f}, backward x{bs:.2f})", _with(ctx.strategy, compiled_modules=blocks))


def compiled_variant(model: JobModel, strategy: Strategy) -> Optional[str]:
    """Which measured variant a strategy's compiled regions are: "compiled" (the whole model),
    "compiled_blocks" (every block separately), or None (nothing compiled, or regions that were not measured)."""
    if "" in strategy.compiled_modules:
        return "compiled" if model.compute_scales("compiled") is not None else None
    blocks = model.fusion_blocks()
    if blocks and strategy.compiled_modules == blocks and model.compute_scales("compiled_blocks") is not None:
        return "compiled_blocks"
    return None


def mixed_precision(ctx: SearchContext) -> Iterable[Candidate]:
    if ctx.strategy.precision == "fp32" and ctx.model.compute_scales("bf16") is not None:
        fs, bs = ctx.model.compute_scales("bf16")
        yield Candidate("mixed_precision", f"bf16 autocast (measured forward x{fs:.2f}, backward x{bs:.2f})",
                        _with(ctx.strategy, precision="bf16"))


def compute_scales(model: JobModel, strategy: Strategy) -> tuple[float, float]:
    """(forward, backward) scale of a strategy's compute passes; compile and bf16 together multiply (measured
    one at a time)."""
    fs = bs = 1.0
    compiled = compiled_variant(model, strategy)
    for applies, variant in ((compiled is not None, compiled), (strategy.precision == "bf16", "bf16")):
        scales = model.compute_scales(variant) if applies else None
        if scales is not None:
            fs, bs = fs * scales[0], bs * scales[1]
    return fs, bs


def memory_candidates(strategy: Strategy, choices=(2, 4, 8)) -> Iterable[Candidate]:
    for s in choices:
        yield Candidate("recompute", f"checkpoint activations in {s} segments",
                        _with(strategy, recompute_segments=s))
    for k in choices:
        yield Candidate("accumulation", f"accumulate gradients over {k} micro-batches",
                        _with(strategy, accumulation_steps=k))


CRITICAL_PATH_PASSES: dict[str, Callable[[SearchContext], Iterable[Candidate]]] = {
    "tensor_partition": tensor_partition,
    "tensor_fusion": tensor_fusion,
    "op_fusion": op_fusion,
    "mixed_precision": mixed_precision,
}
