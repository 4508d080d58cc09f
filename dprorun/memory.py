"""Peak memory per rank: estimated from its parts, compared with the measured peak.

Parts (bytes): the process at DDP construction (interpreter, framework, model parameters and DDP's bucket
buffers: RSS on CPU, allocated CUDA memory on GPU), optimizer state (measured at the end of the window), other
steady memory (GPU: library workspaces such as cuBLAS's and the input batch, i.e. what is allocated when a forward
starts beyond the first two parts and the gradients present then; CPU: what the steady RSS holds beyond all the
parts, since malloc keeps freed heap), gradients (one per trainable parameter), and the larger of the activations
saved for backward in one forward pass (counted by storage through saved-tensor hooks; a weight a layer saves is
not counted, it is a parameter) and the optimizer step's temporaries (runtime/update_memory.py: the activations
are freed by the time the step runs). Measured: on
GPU torch.cuda.max_memory_allocated; on CPU the peak RSS reached during the warm-up iterations (read before the
profiler allocates its own buffers).
"""
from __future__ import annotations

from typing import Optional

from dprorun.trace.model import RankTrace, RunTrace


def peak_from_parts(parts: dict, activation_scale: float = 1.0) -> int:
    """The peak the parts add up to: what is live through the iteration, plus the larger of the activations (scaled
    by a memory what-if: accumulation, re-computation) and the update's temporaries."""
    phased = ("activations", "update_transient")
    fixed = sum(v for k, v in parts.items() if k not in phased and v is not None)
    return int(fixed + max((parts.get("activations") or 0) * activation_scale, parts.get("update_transient") or 0))


def rank_memory(trace: RankTrace, activation_scale: float = 1.0, extra_bytes: int = 0) -> dict:
    memory = trace.memory
    gpu = "cuda_max_allocated_bytes" in memory
    base = memory.get("cuda_allocated_at_ddp_init_bytes" if gpu else "rss_at_ddp_init_bytes")
    grads = sum(trace.param_bytes.values())
    optimizer = memory.get("optimizer_state_bytes", 0)
    activations = memory.get("activation_bytes")
    measured = memory.get("cuda_max_allocated_bytes") if gpu else \
        memory.get("max_rss_before_window_bytes", memory.get("max_rss_bytes"))
    steady = memory.get("cuda_steady_bytes" if gpu else "rss_steady_bytes")
    other = 0
    if steady is not None and base is not None:
        if gpu:  # the caching allocator's count is exact: what is live between iterations beyond the parts
            other = max(0, steady - base - optimizer)
        else:  # RSS keeps heap that malloc has not returned, so steady RSS can already hold freed activations:
            # the peak is at least the steady RSS, and the parts are added only beyond it
            other = max(0, steady - base - optimizer - grads - (activations or 0))
    transient = memory.get("cuda_update_transient_bytes" if gpu else "rss_update_transient_bytes", 0)
    parts = {"at_ddp_init": base, "optimizer_state": optimizer, "other_steady": other, "gradients": grads,
             "activations": None if activations is None else int(activations * activation_scale),
             "update_transient": transient, "extra": extra_bytes}
    estimated: Optional[int] = peak_from_parts(parts) if base is not None else None
    error = None
    if estimated and measured:
        error = round(100.0 * (estimated / measured - 1.0), 2)
    return {"rank": trace.rank, "device": "cuda" if gpu else "cpu", "estimated_peak_bytes": estimated,
            "measured_peak_bytes": measured, "error_pct": error, "parts": parts,
            "complete": None not in parts.values()}


def run_memory(run: RunTrace) -> list[dict]:
    return [rank_memory(run.ranks[r]) for r in sorted(run.ranks)]
