"""The transport a process group's collectives run on, as the cost model needs it ("gloo", "nccl", ...).

`torch.distributed.get_backend()` does not always name it: `init_process_group()` without a backend (and without
device_id) makes a group whose backend torch 2.13 calls "undefined", chosen per device at its first collective (CPU
tensors on gloo, CUDA tensors on NCCL); `init_process_group("cpu:gloo,cuda:nccl")` names the map itself. Taken as
they read, such jobs were calibrated on the CPU though they all-reduce on GPUs, and their gloo calls took Python
callbacks on gloo's threads (runtime/collectives.py avoids those)."""
from __future__ import annotations

from typing import Any, Optional


def job_device_type() -> str:
    """"cuda" where the process has put work on a GPU (CUDA initialised), else "cpu"."""
    import sys

    torch = sys.modules.get("torch")
    try:
        return "cuda" if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized() else "cpu"
    except Exception:
        return "cpu"


def backend_for(name: str, device_type: str) -> str:
    """The backend a group named `name` (what get_backend returned) uses for `device_type` tensors."""
    if name != "undefined" and ":" not in name:
        return name
    mapping = dict(part.split(":", 1) for part in name.split(",") if ":" in part)
    if not mapping:  # "undefined": torch's per-device defaults
        try:
            import torch.distributed as dist

            mapping = dict(dist.Backend.default_device_backend_map)
        except Exception:
            mapping = {"cpu": "gloo", "cuda": "nccl"}
    return mapping.get(device_type, name)


def group_backend(group: Any = None, device_type: Optional[str] = None) -> str:
    """The backend `group` (None: the default group) runs collectives of `device_type` tensors on (None: the job's
    device, `job_device_type`); "unknown" where no group is readable (e.g. destroyed at the job's end)."""
    import torch.distributed as dist

    try:
        name = str(dist.get_backend(group))
    except Exception:
        return "unknown"
    return backend_for(name, device_type or job_device_type())
