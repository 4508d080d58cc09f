"""Applying an optimizer strategy inside a rank, with no change to the training script (dprorun --autotune, or
`dprorun --strategy FILE`). The strategy file is named by DPRO_STRATEGY.

  buckets / bucket_cap_mb  DDP's own bucketing: `bucket_cap_mb`, or per-bucket caps (`bucket_cap_mb_list`, torch
                           versions that have it) chosen so that each bucket closes at its group's last tensor;
                           without that argument the nearest single cap is used and a warning says so
  partitions               the comm hook all-reduces such a bucket in k pieces, all in flight at once
  recompute_segments       an nn.Sequential model's forward runs through torch.utils.checkpoint's
                           checkpoint_sequential; other models: a warning (needs the script)
  compiled_modules         each named submodule ("" = the whole model) gets a torch.compile'd forward before DDP
                           wraps it: op fusion of that region (its backward becomes one graph: its gradients
                           are ready together at the end)
  precision "bf16"         the model's forward (and so its backward) runs under torch.autocast with bfloat16 on
                           the model's device type; parameters, gradients and their all-reduce stay fp32
  accumulation_steps       needs the script (its batches change): not applied, reported
Every choice made here is recorded in the rank's events (meta "strategy") and so in the run directory.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Optional

from dprorun.strategy import Strategy, current

MB = 1 << 20


def load() -> tuple[Optional[Strategy], Optional[str]]:
    """The strategy this rank should apply, or (None, why not) when DPRO_STRATEGY names a bad file."""
    try:
        return current(), None
    except Exception as exc:  # a bad strategy file must not stop training: run with the job's own settings
        return None, f"strategy not applied: {exc}"


def ddp_init_kwargs(strategy: Strategy, init: Callable, args: tuple, kwargs: dict,
                    applied: dict[str, Any], warnings: list[str]) -> dict:
    """DDP constructor arguments that realise the strategy's bucket layout."""
    kwargs = dict(kwargs)
    if strategy.buckets:
        module = args[0] if args else kwargs.get("module")
        sizes = {name: p.numel() * p.element_size() for name, p in module.named_parameters() if p.requires_grad}
        missing = [name for group in strategy.buckets for name in group if name not in sizes]
        if missing:
            warnings.append(f"strategy buckets name parameters this model lacks ({missing[:3]}): "
                            "bucket layout not applied")
            return kwargs
        group_mb = [sum(sizes[n] for n in group) / MB for group in strategy.buckets]
        if strategy.bucket_cap_mb is not None:
            kwargs["bucket_cap_mb"] = strategy.bucket_cap_mb
            kwargs.pop("bucket_cap_mb_list", None)
            applied["bucket_cap_mb"] = strategy.bucket_cap_mb
        elif "bucket_cap_mb_list" in inspect.signature(init).parameters:
            kwargs["bucket_cap_mb_list"] = group_mb
            applied["bucket_cap_mb_list"] = [round(x, 6) for x in group_mb]
        else:
            cap = max(group_mb)
            kwargs["bucket_cap_mb"] = cap
            applied["bucket_cap_mb"] = cap
            warnings.append("this torch has no bucket_cap_mb_list: the strategy's buckets are approximated by "
                            f"one cap of {cap:.2f} MB")
    elif strategy.bucket_cap_mb is not None:
        kwargs["bucket_cap_mb"] = strategy.bucket_cap_mb
        applied["bucket_cap_mb"] = strategy.bucket_cap_mb
    return kwargs


def apply_recompute(strategy: Strategy, module, applied: dict[str, Any], warnings: list[str]) -> None:
    segments = strategy.recompute_segments
    if segments <= 1:
        return
    import torch

    if not isinstance(module, torch.nn.Sequential):
        warnings.append(f"re-computation in {segments} segments needs an nn.Sequential model or the script's "
                        "cooperation (torch.utils.checkpoint): not applied")
        return
    from torch.utils.checkpoint import checkpoint_sequential

    if "" in strategy.compiled_modules:
        warnings.append("re-computation replaces the compiled forward of the whole model: it runs uncompiled")

    original = module.forward
    count = min(segments, len(module))

    def forward(inputs):
        if torch.is_grad_enabled() and module.training:
            return checkpoint_sequential(module, count, inputs, use_reentrant=False)
        return original(inputs)

    module.forward = forward
    applied["recompute_segments"] = count


def apply_compile(strategy: Strategy, module, applied: dict[str, Any], warnings: list[str]) -> None:
    """torch.compile of the strategy's regions, in place, so DDP and the rest of the hooks see the same modules."""
    if not strategy.compiled_modules:
        return
    import torch

    if not hasattr(torch, "compile"):
        warnings.append("this torch has no torch.compile: compiled regions not applied")
        return
    modules = dict(module.named_modules())
    done, missing = [], []
    for name in strategy.compiled_modules:
        target = modules.get(name)
        if target is None:
            missing.append(name)
            continue
        # the module's forward, not nn.Module.compile(): compiling _call_impl in place measured 1.6x slower than
        # torch.compile(module) on resnet_small (CPU); a compiled forward matches it and keeps the module object
        target.forward = torch.compile(target.forward)
        done.append(name)
    if missing:
        warnings.append(f"strategy compiles modules this model lacks ({missing[:3]}): those not compiled")
    if done:
        applied["compiled_modules"] = done


def apply_precision(strategy: Strategy, module, applied: dict[str, Any], warnings: list[str]) -> None:
    """bf16 autocast around the model's forward (the backward follows the forward's dtypes)."""
    if strategy.precision in ("fp32", "", None):
        return
    if strategy.precision != "bf16":
        warnings.append(f"precision {strategy.precision!r} is not one dprorun applies (fp32, bf16): not applied")
        return
    import torch

    try:
        device_type = next(module.parameters()).device.type
    except StopIteration:
        device_type = "cpu"
    if device_type == "cuda" and not torch.cuda.is_bf16_supported():
        warnings.append("this GPU has no bf16 support: precision bf16 not applied")
        return
    original = module.forward

    def forward(*args, **kwargs):
        with torch.autocast(device_type=device_type, dtype=torch.bfloat16):
            return original(*args, **kwargs)

    module.forward = forward
    applied["precision"] = f"bf16 autocast on {device_type}"


_GROUPS: dict = {}  # DDP's process group (None: the default one) -> the group object, resolved once


def resolve_group(process_group):
    group = _GROUPS.get(id(process_group))
    if group is None:
        import torch.distributed as dist

        group = process_group if process_group is not None else dist.group.WORLD
        _GROUPS[id(process_group)] = group
    return group


def partitioned_allreduce(process_group, bucket, pieces: int):
    """DDP's default semantics (mean over ranks) with the bucket's all-reduce split into `pieces` chunks that
    are all in flight at once; completes when every chunk has."""
    import torch

    group = resolve_group(process_group)
    tensor = bucket.buffer()
    tensor.div_(group.size())
    chunks = [c for c in torch.tensor_split(tensor, pieces) if c.numel()]
    futures = [group.allreduce([c]).get_future() for c in chunks]

    def finished(_):
        return tensor

    return torch.futures.collect_all(futures).then(finished)


def pieces_for(strategy: Optional[Strategy], bucket_index: int) -> int:
    if strategy is None:
        return 1
    return max(1, int(strategy.partitions.get(f"bucket{bucket_index}", 1)))


def not_applied_notes(strategy: Strategy) -> list[str]:
    notes = []
    if strategy.accumulation_steps > 1:
        notes.append(f"gradient accumulation over {strategy.accumulation_steps} micro-batches needs the script "
                     "(dprorun.strategy().accumulation_steps): not applied by the hooks")
    return notes
