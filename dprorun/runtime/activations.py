"""Activation memory of one forward pass: the bytes autograd saves for backward, counted once per storage.

Installed around exactly one forward of the DDP module in the profiling window through
torch.autograd.graph.saved_tensors_hooks; the hooks return tensors unchanged.
"""
from __future__ import annotations

from typing import Optional


class SavedTensorMeter:
    def __init__(self) -> None:
        self.storages: dict[int, int] = {}
        self._context = None

    def _pack(self, tensor):
        try:
            storage = tensor.untyped_storage()
            self.storages.setdefault(storage.data_ptr(), storage.nbytes())
        except Exception:
            pass
        return tensor

    @staticmethod
    def _unpack(tensor):
        return tensor

    def start(self) -> None:
        from torch.autograd.graph import saved_tensors_hooks

        self._context = saved_tensors_hooks(self._pack, self._unpack)
        self._context.__enter__()

    def stop(self) -> Optional[int]:
        if self._context is None:
            return None
        self._context.__exit__(None, None, None)
        self._context = None
        return sum(self.storages.values())
