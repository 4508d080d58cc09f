"""The optimizer step's own temporaries, read around the first optimizer steps of a DDP job: the peak memory above
what the step leaves allocated (foreach Adam and AdamW hold a square root of the second moment, as large as the
parameters, while they update; a weight decay's copy of the gradients; ...). The peak model (dprorun.memory) takes
the larger of these and the activations, since the activations are freed by the time the step runs.

Only a step that raises the process's peak shows its temporaries: the peak counters are not reset (a script may
read them itself). That is the case that matters: a step whose temporaries stay under the backward's peak does not
set the job's peak. GPU: the caching allocator's counts; CPU: resident memory (VmHWM against the RSS after the
step). Read in the warm-up iterations only, before any profiler buffer exists; a step given a closure (LBFGS,
Lightning's automatic optimisation) runs the forward and backward inside it and is not read.
"""
from __future__ import annotations

from typing import Callable, Optional

TRANSIENT_KEYS = ("cuda_update_transient_bytes", "rss_update_transient_bytes")


def _has_closure(args: tuple, kwargs: dict) -> bool:
    return callable(kwargs.get("closure")) or (len(args) > 1 and callable(args[1]))


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

    def start(self) -> None:
        import torch
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        self.cuda = torch.cuda.is_available()
        what = "reading memory around the optimizer step"
        self.handles = [register_optimizer_step_pre_hook(lambda o, a, k: self.guard(what, self._pre, a, k)),
                        register_optimizer_step_post_hook(lambda o, a, k: self.guard(what, self._post))]

    def stop(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def _counts(self) -> tuple[Optional[int], Optional[int]]:
        """(peak so far, allocated now) in bytes."""
        if self.cuda:
            import torch

            return int(torch.cuda.max_memory_allocated()), int(torch.cuda.memory_allocated())
        import psutil

        from dprorun.runtime.rank_files import peak_rss_bytes

        return peak_rss_bytes(), psutil.Process().memory_info().rss

    def _pre(self, args: tuple, kwargs: dict) -> None:
        self.peak_before = None
        if self.done or not self.reading():
            self.done = True
        elif not _has_closure(args, kwargs):
            self.peak_before = self._counts()[0]

    def _post(self) -> None:
        if self.peak_before is None:
            return
        peak, now = self._counts()
        if peak is not None and now is not None and peak > self.peak_before:
            key = TRANSIENT_KEYS[0] if self.cuda else TRANSIENT_KEYS[1]
            self.memory[key] = max(self.memory.get(key, 0), peak - now)
        self.peak_before = None
        self.steps_left -= 1
        self.done = self.steps_left <= 0
