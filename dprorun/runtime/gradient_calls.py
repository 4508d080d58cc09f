"""The collective calls a script shares its gradients with by hand, as runtime/collectives.py records them: which
calls carry the gradients and which gather the parameters after a sharded step, the tensors each covers, and the
collective each is on the ring; torch.distributed's calls and horovod.torch's.

horovod.torch with no hvd.DistributedOptimizer (the script averages the gradients itself):
  - hvd.allreduce, allreduce_, grouped_allreduce return once their all-reduce is done (a synchronous call);
  - their async forms (allreduce_async, allreduce_async_, grouped_allreduce_async, grouped_allreduce_async_) return
    a handle: the record ends where hvd.synchronize(handle) returns (`HandleWork`; an upper bound of its
    completion, as for DistributedOptimizer's own calls, runtime/horovod.py);
  - hvd.reducescatter (an optimizer sharded by hand: the gradient summed, each rank keeping its shard) and
    hvd.allgather after the step (the parameters gathered again: it covers its output, the ranks' inputs together).
The DistributedOptimizer calls horovod.torch.mpi_ops' functions directly, never these names (runtime/watch.py).
"""
from __future__ import annotations

import sys
from typing import Any, Callable

from dprorun.runtime.watch import call_tensors

# call -> the collective it is on the ring: "all_reduce", "reduce_scatter" (the gradients' sum, each rank keeping its
# shard: ZeRO's optimizer sharding by hand), or "all_gather" (the parameters gathered after a sharded step)
TORCH_KINDS = {"all_reduce": "all_reduce", "reduce_scatter": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
               "reduce_scatter_single": "reduce_scatter", "all_gather_into_tensor": "all_gather",
               "all_gather_single": "all_gather", "all_gather": "all_gather"}
HOROVOD_KINDS = {**{name: "all_reduce" for name in ("allreduce", "allreduce_", "grouped_allreduce", "allreduce_async",
                                                    "allreduce_async_", "grouped_allreduce_async",
                                                    "grouped_allreduce_async_")},
                 "reducescatter": "reduce_scatter", "reducescatter_async": "reduce_scatter",
                 "allgather": "all_gather", "allgather_async": "all_gather"}
KINDS = {**TORCH_KINDS, **HOROVOD_KINDS}
GRADIENT_COLLECTIVES = tuple(name for name, kind in KINDS.items() if kind != "all_gather")
PARAMETER_GATHERS = tuple(name for name, kind in KINDS.items() if kind == "all_gather")
HOROVOD_ASYNC = tuple(name for name in HOROVOD_KINDS if "_async" in name)
# call -> where the tensor(s) it covers are (position, keyword): the gradients a reduce-scatter sums (its input), the
# parameters a torch all-gather fills (its output); horovod.torch's calls take their input first (an all-gather's
# output is the ranks' inputs together: `covered` counts it so)
COVERED = {"all_reduce": (0, "tensor"), "reduce_scatter": (1, "input_list"), "reduce_scatter_tensor": (1, "input"),
           "reduce_scatter_single": (1, "input"), "all_gather_into_tensor": (0, "output_tensor"),
           "all_gather_single": (0, "output_tensor"), "all_gather": (0, "tensor_list"),
           **{name: (0, "tensors" if name.startswith("grouped") else "tensor") for name in HOROVOD_KINDS}}


def covered(name: str, args: tuple, kwargs: dict) -> tuple[Any, int]:
    """(the first tensor a collective covers, the bytes of all it covers): an all-reduce's tensor(s), a
    reduce-scatter's input (the gradients summed), an all-gather's output (the parameters filled)."""
    tensors = call_tensors(args, kwargs, *COVERED[name])
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    if name in HOROVOD_KINDS and KINDS[name] == "all_gather":
        nbytes *= _horovod_size()
    return (tensors[0] if tensors else None), nbytes


def _horovod_size() -> int:
    try:
        return int(sys.modules["horovod.torch"].size())
    except Exception:
        return 1


def bucket_entry(name: str, tensor, nbytes: int, names: list[str]) -> dict:
    """A bucket's description (the layout's): the bytes its call covers, and the kind of collective where it is not
    an all-reduce (a reduce-scatter or an all-gather: half the ring's traffic, replay/build.py)."""
    numel = nbytes // tensor.element_size() if tensor is not None and tensor.element_size() else 0
    entry = {"nbytes": nbytes, "numel": numel, "params": names,
             "dtype": str(getattr(tensor, "dtype", "")).replace("torch.", "")}
    if KINDS[name] != "all_reduce":
        entry["collective"] = KINDS[name]
    return entry


class HandleWork:
    """An async horovod.torch call's handle, read as the tracker reads a torch Work (`get_future().
    add_done_callback`): done when hvd.synchronize(handle) returns (`HandleWorks.synchronized`)."""

    def __init__(self) -> None:
        self.callbacks: list[Callable[[Any], None]] = []

    def get_future(self) -> "HandleWork":
        return self

    def add_done_callback(self, callback: Callable[[Any], None]) -> None:
        self.callbacks.append(callback)

    def done(self) -> None:
        for callback in self.callbacks:
            callback(self)
        self.callbacks.clear()


class HandleWorks:
    """The recorded async horovod.torch calls not yet synchronized, by handle."""

    def __init__(self) -> None:
        self.pending: dict[Any, HandleWork] = {}

    def work(self, name: str, result: Any) -> Any:
        """What the tracker reads as the call's Work: a HandleWork for an async horovod.torch call's handle, the
        result itself (a torch Work, or None) otherwise."""
        if name not in HOROVOD_ASYNC:
            return result if hasattr(result, "get_future") else None
        work = self.pending[result] = HandleWork()
        return work

    def synchronized(self, handle: Any) -> None:
        try:
            work = self.pending.pop(handle, None)
        except TypeError:  # an unhashable handle: none of ours
            return
        if work is not None:
            work.done()


GROUP_POSITION = {"all_reduce": 2, "all_gather": 2, "all_gather_into_tensor": 2, "all_gather_single": 2,
                  "reduce_scatter": 3, "reduce_scatter_tensor": 3, "reduce_scatter_single": 3}


def group_size(name: str, args: tuple, kwargs: dict) -> int:
    """The size of the process group a collective call runs in (0 where unreadable)."""
    import torch.distributed as dist

    position = GROUP_POSITION.get(name, -1)
    group = kwargs.get("group", args[position] if 0 <= position < len(args) else None)
    try:
        return int(dist.get_world_size(group))
    except Exception:  # a group this rank is not in, or one already destroyed
        return 0


def fsdp_blocks() -> bool:
    """Do FSDP's calls block the thread that makes them, in program order (the CPU: gloo, no CUDA in use)? On a GPU
    FSDP runs them on streams of its own, overlapped with the compute."""
    from dprorun.runtime.backends import group_backend, job_device_type

    return job_device_type() == "cpu" and group_backend() == "gloo"


def gradient_bytes(optimizer) -> int:
    """The bytes of the optimizer's parameters' gradients (those that have one)."""
    return sum(p.grad.numel() * p.grad.element_size() for group in optimizer.param_groups for p in group["params"]
               if getattr(p, "grad", None) is not None)
