"""The optimizer step's own temporaries, read around the first optimizer steps of a DDP job: the peak memory above
what the step leaves allocated (foreach Adam and AdamW hold a square root of the second moment, as large as the
parameters, while they update; a weight decay's copy of the gradients; ...). The peak model (dprorun.memory) takes
the larger of these and the activations, since the activations are freed by the time the step runs.

Only a step that raises the process's peak shows its temporaries: the peak counters are not reset (a script may
read them itself). That is the case that matters: a step whose temporaries stay under the backward's peak does not
set the job's peak (GPU: the caching allocator's counts; CPU: below). Read in the warm-up iterations only, before
any profiler buffer exists; a step given a closure (LBFGS, Lightning's automatic optimisation) runs the forward and
backward inside it and is not read.

On CPU the resident memory cannot show them: right after the step the RSS still holds the temporaries' pages (glibc
keeps freed chunks; VmHWM equalled the RSS after every step read, 0 bytes in every run), yet they raise the job's
peak (Adam's single-tensor step on CPU makes a square root of the second moment and a quotient of it, two
temporaries the size of the largest parameter). There the step's tensors are counted instead: a dispatch mode over
the step (`StepAllocations`) adds each new tensor an op makes and subtracts it when it is freed; the temporaries are
the peak of that count minus what is still alive at the step's end (the optimizer state it creates).
"""
from __future__ import annotations

import weakref
from typing import Callable, Optional

TRANSIENT_KEYS = ("cuda_update_transient_bytes", "rss_update_transient_bytes")


def _has_closure(args: tuple, kwargs: dict) -> bool:
    return callable(kwargs.get("closure")) or (len(args) > 1 and callable(args[1]))


def _step_allocations_mode():
    """A TorchDispatchMode that counts the bytes of the new tensors the ops under it make (not views, not in-place
    results), live and at their peak. Made on first use: torch is imported by then."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class StepAllocations(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.live = 0
            self.peak = 0
            self.failed: Optional[str] = None  # the counting met something it cannot read: no figure

        def _freed(self, nbytes: int) -> None:
            self.live -= nbytes

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if self.failed is None:
                try:  # the script's step must never see the counting fail
                    self._count(args, kwargs, out)
                except Exception as exc:
                    self.failed = f"{type(exc).__name__}: {exc}"
            return out

        def _count(self, args, kwargs, out) -> None:
            import torch
            from torch.utils._pytree import tree_leaves

            strided = [t for t in tree_leaves((args, kwargs or {}))
                       if isinstance(t, torch.Tensor) and t.layout == torch.strided]
            inputs = {t.untyped_storage().data_ptr() for t in strided}
            for tensor in (t for t in tree_leaves(out) if isinstance(t, torch.Tensor)):
                if tensor.layout != torch.strided:  # a sparse tensor has no storage of its own: not counted
                    continue
                if tensor._is_view() or tensor.untyped_storage().data_ptr() in inputs:
                    continue
                nbytes = tensor.untyped_storage().nbytes()
                self.live += nbytes
                self.peak = max(self.peak, self.live)
                weakref.finalize(tensor, self._freed, nbytes)

    return StepAllocations()


class UpdateMemoryMeter:
    """Reads the first `steps` optimizer steps while `reading()` holds, into `memory` (the rank's records); `guard`
    runs each reading so that a failure disables profiling instead of reaching the script's step."""

    def __init__(self, memory: dict, steps: int, reading: Callable[[], bool], guard: Callable):
        self.memory = memory
        self.steps_left = steps
        self.reading = reading
        self.guard = guard
        self.handles: list = []
        self.peak_before: Optional[int] = None
        self.cuda = False
        self.done = False  # the hooks are removed by stop() outside a step: torch iterates over them during one
        self.counting = None  # CPU: the dispatch mode counting the step's tensors while it runs

    def start(self) -> None:
        import torch
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        self.cuda = torch.cuda.is_available()
        what = "reading memory around the optimizer step"
        self.handles = [register_optimizer_step_pre_hook(lambda o, a, k: self.guard(what, self._pre, a, k)),
                        register_optimizer_step_post_hook(lambda o, a, k: self.guard(what, self._post))]

    def stop(self) -> None:
        self._stop_counting()
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def _counts(self) -> tuple[Optional[int], Optional[int]]:
        """(peak so far, allocated now) in bytes."""
        if self.cuda:
            import torch

            return int(torch.cuda.max_memory_allocated()), int(torch.cuda.memory_allocated())
        from dprorun.runtime.rank_files import current_rss_bytes, peak_rss_bytes

        return peak_rss_bytes(), current_rss_bytes()

    def _pre(self, args: tuple, kwargs: dict) -> None:
        self.peak_before = None
        self._stop_counting()  # a step that raised left it on
        if self.done or not self.reading():
            self.done = True
        elif not _has_closure(args, kwargs):
            self.peak_before = self._counts()[0]
            if not self.cuda:
                self.counting = _step_allocations_mode()
                self.counting.__enter__()

    def _stop_counting(self) -> Optional[int]:
        """Ends the CPU count; the step's temporaries in bytes (None: none was counting)."""
        counting, self.counting = self.counting, None
        if counting is None:
            return None
        counting.__exit__(None, None, None)
        if counting.failed is not None:
            self.done = True  # read no further step
            return None
        return max(0, counting.peak - counting.live)

    def _post(self) -> None:
        counted = self.counting is not None  # CPU: the step's tensors were counted (a failed count gives no figure)
        transient = self._stop_counting()
        if self.peak_before is None:
            return
        if counted:
            if transient is not None:
                self.memory[TRANSIENT_KEYS[1]] = max(self.memory.get(TRANSIENT_KEYS[1], 0), transient)
        else:
            peak, now = self._counts()
            if peak is not None and now is not None and peak > self.peak_before:
                key = TRANSIENT_KEYS[0] if self.cuda else TRANSIENT_KEYS[1]
                self.memory[key] = max(self.memory.get(key, 0), peak - now)
        self.peak_before = None
        self.steps_left -= 1
        self.done = self.done or self.steps_left <= 0
