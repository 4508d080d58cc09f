"""What a forward returned, searched for the tensors autograd runs back through (the DDP tracker's backward span,
the compute variants' stand-in loss): tensors, dicts (Hugging Face's ModelOutput), lists, tuples, dataclasses and
other objects' attributes."""
from __future__ import annotations

from typing import Any

MAX_OUTPUT_TENSORS = 64


def tensors_requiring_grad(obj: Any, found: list, depth: int = 0) -> None:
    """The tensors of a forward's output that autograd runs back through: in tensors, dicts (Hugging Face's
    ModelOutput), lists, tuples, dataclasses (a model returning `Output(logits=..., features=...)`, which DDP
    itself searches: its backward went unseen, and the job had no replay) and other objects' attributes."""
    import dataclasses

    import torch

    if len(found) >= MAX_OUTPUT_TENSORS or depth > 6:
        return
    if isinstance(obj, torch.Tensor):
        if obj.requires_grad:
            found.append(obj)
    elif isinstance(obj, dict):
        for value in obj.values():
            tensors_requiring_grad(value, found, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            tensors_requiring_grad(value, found, depth + 1)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for item in dataclasses.fields(obj):
            tensors_requiring_grad(getattr(obj, item.name, None), found, depth + 1)
    elif not isinstance(obj, (type, torch.nn.Module, str, bytes)) and isinstance(getattr(obj, "__dict__", None), dict):
        for value in list(vars(obj).values())[:MAX_OUTPUT_TENSORS]:  # an output class of the script's own
            tensors_requiring_grad(value, found, depth + 1)
