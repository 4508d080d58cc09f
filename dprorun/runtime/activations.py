"""Activation memory of one forward pass: the bytes autograd saves for backward, counted once per storage.

Installed around exactly one forward of the DDP module in the profiling window through
torch.autograd.graph.saved_tensors_hooks; the hooks return tensors unchanged. The module's own parameters and
buffers are not counted: a Linear or a convolution saves its weight for the backward, but that storage is already
held (the process at DDP construction), so counting it doubled the parameters in the peak estimate (a 24-layer MLP:
6.0 MiB of saved weights against 0.8 MiB of real activations).

A script's own saved-tensor hooks around that forward (torch.autograd.graph.save_on_cpu offloading the activations
to the host, or hooks of its own) stay in force: autograd calls only the innermost pair, so the meter calls them
itself and counts what they keep on the tensor's device (save_on_cpu's host copies of a GPU job's activations do not
count; on a CPU job the copy is the tensor itself and does). Before, the meter's pair replaced the script's for that
forward: a GPU job offloading to fit kept one forward's activations on the device.
"""
from __future__ import annotations

from typing import Optional


class SavedTensorMeter:
    def __init__(self, held_storages: frozenset[int] = frozenset()) -> None:
        self.storages: dict[int, int] = {}
        self.held_storages = held_storages  # data pointers of storages that exist anyway (parameters, buffers)
        self._context = None
        self._outer: Optional[tuple] = None  # the script's (pack, unpack) in force when the meter started, if any

    @staticmethod
    def for_module(module) -> "SavedTensorMeter":
        """A meter that leaves out what the module holds between iterations: its parameters and buffers."""
        held = set()
        for tensor in list(module.parameters()) + list(module.buffers()):
            try:
                held.add(tensor.untyped_storage().data_ptr())
            except Exception:  # a tensor without storage (meta, sparse): nothing it could share
                pass
        return SavedTensorMeter(frozenset(held))

    def _count(self, tensor) -> None:
        try:
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in self.held_storages:
                self.storages.setdefault(storage.data_ptr(), storage.nbytes())
        except Exception:
            pass

    def _pack(self, tensor):
        if self._outer is None:
            self._count(tensor)
            return tensor
        packed = self._outer[0](tensor)
        for kept in packed if isinstance(packed, (tuple, list)) else (packed,):
            if hasattr(kept, "untyped_storage") and getattr(kept, "device", None) == tensor.device:
                self._count(kept)
        return packed

    def _unpack(self, packed):
        return packed if self._outer is None else self._outer[1](packed)

    def start(self) -> None:
        import torch
        from torch.autograd.graph import saved_tensors_hooks

        self._outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        self._context = saved_tensors_hooks(self._pack, self._unpack)
        self._context.__enter__()

    def stop(self) -> Optional[int]:
        if self._context is None:
            return None
        self._context.__exit__(None, None, None)
        self._context = None
        return sum(self.storages.values())
