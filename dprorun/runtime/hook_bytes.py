"""What a script's own DDP comm hook sends: PowerSGD's low-rank factors, a hand-written top-k, a cast to fp16. The
bytes of the torch.distributed collectives the hook issues are counted per profiled iteration: those called inside
the hook (a bucket's first collective) and those called from another thread while one of its buckets is in flight
(PowerSGD chains its second and third all-reduce in future callbacks, which run on the process group's threads).
At the window's end the counted bytes over the hooked buckets' gradient bytes give the wire ratio that the
what-ifs price (a bucket's nbytes; buffer_nbytes keeps its gradients' size). A hook that sends through nothing
this sees (a ProcessGroup method, C++) leaves the buckets at their gradients' size, and the run says so.
Collectives of the script's own on its main thread (a loss all-reduced for logging) are not the hook's.
"""
from __future__ import annotations

import statistics
import threading
from typing import TYPE_CHECKING, Any, Callable, Optional

if TYPE_CHECKING:
    from dprorun.runtime.session import RankSession

# torch.distributed function -> where its sent tensor is: (position, keyword); runtime/watch.py tells of the calls
COLLECTIVES = {"all_reduce": (0, "tensor"), "broadcast": (0, "tensor"), "reduce": (0, "tensor"),
               "all_gather": (1, "tensor"), "all_gather_into_tensor": (1, "input_tensor"),
               "all_gather_single": (1, "input_tensor"), "reduce_scatter_tensor": (1, "input"),
               "reduce_scatter_single": (1, "input"), "reduce_scatter": (1, "input_list")}
MIN_RATIO_CHANGE = 0.02  # a hook within 2 % of the gradients' bytes sends them as they are


def _sent_bytes(name: str, args: tuple, kwargs: dict) -> int:
    from dprorun.runtime.watch import call_tensors

    return sum(int(t.numel() * t.element_size()) for t in call_tensors(args, kwargs, *COLLECTIVES[name]))


class HookBytesMeter:
    """Counts the collectives of the script's comm hooks over the profiled iterations (`counting()`)."""

    def __init__(self, session: "RankSession", counting: Callable[[], bool]):
        self.session = session
        self.counting = counting
        self.local = threading.local()
        self.lock = threading.Lock()
        self.in_flight = 0
        self.main_thread = threading.main_thread()
        self.bytes_by_iteration: dict[int, int] = {}
        self.finished = False

    def start(self) -> None:
        self.session.script_use.listeners.append(self.observe)

    def stop(self) -> None:
        if self.observe in self.session.script_use.listeners:
            self.session.script_use.listeners.remove(self.observe)

    def observe(self, name: str, args: tuple, kwargs: dict) -> None:
        """A torch.distributed collective about to run (runtime/watch.py): counted when the hook made it."""
        if name in COLLECTIVES and self._hooks_call():
            nbytes = _sent_bytes(name, args, kwargs)
            with self.lock:
                iteration = self.session.iteration
                self.bytes_by_iteration[iteration] = self.bytes_by_iteration.get(iteration, 0) + nbytes

    def _hooks_call(self) -> bool:
        return self.counting() and self.from_hook()

    def from_hook(self) -> bool:
        """Is the calling thread inside the script's comm hook, or one of its buckets' callbacks?"""
        if getattr(self.local, "depth", 0) > 0:
            return True
        return self.in_flight > 0 and threading.current_thread() is not self.main_thread

    def call_hook(self, inner: Callable, state: Any, bucket: Any) -> Any:
        """inner(state, bucket), its collectives counted; the bucket in flight until its future completes."""
        self.local.depth = getattr(self.local, "depth", 0) + 1
        with self.lock:
            self.in_flight += 1
        try:
            future = inner(state, bucket)
        except BaseException:
            with self.lock:
                self.in_flight -= 1
            raise
        finally:
            self.local.depth -= 1

        def landed(fut):
            with self.lock:
                self.in_flight -= 1
            return fut.value()

        return future.then(landed)

    def wire_ratio(self, gradient_bytes: int) -> Optional[float]:
        """Median over the profiled iterations of the bytes counted over the hooked buckets' gradient bytes (None:
        nothing counted)."""
        ratios = [sent / gradient_bytes for sent in self.bytes_by_iteration.values() if sent > 0]
        return statistics.median(ratios) if ratios and gradient_bytes > 0 else None

    def finish(self, buckets: dict, hooked: dict[int, str]) -> None:
        """At the window's end: the hooked DDP modules' buckets (records.buckets, keyed (ddp, bucket)) get the
        measured wire bytes; `hooked`: DDP index -> the hook's name."""
        if self.finished:
            return
        self.finished = True
        self.stop()
        entries = [entry for (ddp, _), entry in buckets.items() if ddp in hooked and not entry.get("sparse")]
        gradient_bytes = sum(entry.get("buffer_nbytes") or entry["nbytes"] for entry in entries)
        ratio = self.wire_ratio(gradient_bytes)
        names = ", ".join(sorted(set(hooked.values())))
        if ratio is None:
            self.session.records.warnings.append(
                f"the script's comm hook ({names}) sent through nothing dprorun counts (torch.distributed's "
                "functions): its buckets are priced at their gradients' size in what-ifs")
            return
        if abs(ratio - 1.0) <= MIN_RATIO_CHANGE and not any(entry.get("buffer_nbytes") for entry in entries):
            return
        for entry in entries:
            gradients = entry.get("buffer_nbytes") or entry["nbytes"]
            entry.update(buffer_nbytes=gradients, nbytes=max(1, int(round(gradients * ratio))),
                         wire_measured=round(ratio, 4))
