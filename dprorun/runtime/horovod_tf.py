"""Hooks in a horovod.tensorflow worker (`dprorun --backend horovod`), with no change to the script.

Training steps: as in TensorFlow's MultiWorkerMirroredStrategy workers (runtime/tf.py), a `tf.function` is a step
function when its tracing calls Horovod's all-reduce (`DistributedGradientTape.gradient`, the tf-keras
`hvd.DistributedOptimizer`, or `hvd.allreduce` / `hvd.grouped_allreduce` called by the script); each call of it
from outside any tf.function is one iteration. Horovod's own helpers that wrap its all-reduce into a
tf.function when called eagerly are not step functions.
Tensors: while a step function is traced, every tensor handed to `horovod.tensorflow._allreduce` (or a group to
`_grouped_allreduce`) is recorded with its bytes and the Horovod op it becomes; each is its own bucket (Horovod fuses
them at run time: its timeline, recorded in the window's first --kineto-iters iterations, says how).
Profiler: TensorFlow's, over the same iterations (`rank_<r>/xplane.pb`), for the compute ops. It records none of
Horovod's asynchronous ops: each tensor's all-reduce runs from its gradient being ready (the profile) to the end of
its operation in Horovod's timeline (trace/tf_records.add_tf_records).
End of the window: a timed all-reduce of each calibration size through horovod.tensorflow (eager), the events
written by every worker into the run directory on its own host.
"""
from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from dprorun.runtime.horovod_timeline import WindowTimeline
from dprorun.runtime.script_profiler import watch_tf
from dprorun.runtime.tf import TFTracker, names_and_bytes, patch_step_functions

if TYPE_CHECKING:
    from dprorun.runtime.session import RankSession


class HorovodTFTracker(TFTracker):
    """One per worker of a horovod.tensorflow job: step functions, the tensors they all-reduce, profiler and
    Horovod's timeline."""

    framework = "horovod"

    def __init__(self, session: "RankSession"):
        super().__init__(session)
        # per step function (its key), per all-reduce traced into it: tensors, bytes, op
        self.tensors_by_function: dict[int, list[dict]] = {}
        self.timeline = WindowTimeline(session, "horovod.tensorflow")

    def describe(self) -> dict:
        return {"framework": "horovod", "backend": "horovod", "tf": True, "timed_buckets": False,
                "step_functions": len(self.step_functions), "eager_steps": False,
                "packs": [{"tensors": list(t["tensors"]), "bytes": list(t["bytes"]), "op": t["op"]}
                          for t in self.tensors]}

    @property
    def tensors(self) -> list[dict]:
        """The all-reduces of the step function the window ran (or of the first one traced)."""
        if self.window_function in self.tensors_by_function:
            return self.tensors_by_function[self.window_function]
        return next(iter(self.tensors_by_function.values()), [])

    # ---- Horovod's timeline over the detailed tier (as for horovod.torch) ---------------------------------
    def start_profiler(self) -> None:
        super().start_profiler()
        self.timeline.start()

    def stop_profiler(self, write: bool) -> None:
        self.timeline.stop()
        super().stop_profiler(write)

    def window_stopped(self) -> None:
        self.timeline.stop()

    # ---- tracing ------------------------------------------------------------------------------------------
    def is_step(self, key: int) -> bool:
        """Every function that all-reduces through Horovod while traced (its DistributedGradientTape or
        optimizer's gradients) is a step."""
        return key in self.step_functions

    def traced_allreduce(self, tensors: list, op_name: str) -> None:
        """An all-reduce met while a tf.function is traced: that function is a step function (unless it is
        Horovod's own wrapper), and its tensors are recorded (per step function: the window's are reported)."""
        stack = self.call_stack()
        if not stack:
            return  # eager: Horovod's _make_subgraph wraps eager calls into a tf.function of its own
        outer = stack[0]
        module = getattr(getattr(outer, "_python_function", None), "__module__", "") or ""
        if module.startswith("horovod."):
            return
        key = self.key(outer)
        self.step_functions.add(key)
        self.syncing_functions.add(key)  # every step function seen here all-reduces (see TFTracker.run_step)
        traced = self.tensors_by_function.setdefault(key, [])
        if any(t["op"] == op_name for t in traced):
            return  # the same function traced again (another input signature)
        names, sizes = names_and_bytes(tensors)
        traced.append({"tensors": names, "bytes": sizes, "op": op_name})


def _op_name(prefix: str, tensors: list, name) -> str:
    """The Horovod op's name as horovod.tensorflow.mpi_ops gives it in graph mode (before TensorFlow's name
    scope is prepended)."""
    if name is not None:
        return str(name)
    from horovod.tensorflow.mpi_ops import _normalize_name

    if prefix == "HorovodAllreduce":
        return f"HorovodAllreduce_{_normalize_name(tensors[0].name)}"
    return _normalize_name(f"HorovodGroupedAllreduce_{tensors[0].name}_{tensors[-1].name}")


def patch_horovod_tensorflow(session: "RankSession") -> HorovodTFTracker:
    """Patch tf.function calls (steps) and horovod.tensorflow's all-reduce entry points (tensors)."""
    import horovod.tensorflow as hvd_tf

    tracker = HorovodTFTracker(session)
    session.profiler_backend = tracker
    session.framework = "tf"
    session.guard("watching the script's profiler", watch_tf, session)
    allreduce = hvd_tf._allreduce
    grouped = hvd_tf._grouped_allreduce

    def traced_allreduce(tensor, *args, **kwargs):
        if tracker.call_stack() and not session.disabled:
            name = kwargs.get("name", args[0] if args else None)
            session.guard("recording Horovod's all-reduce", tracker.traced_allreduce, [tensor],
                          _op_name("HorovodAllreduce", [tensor], name))
        return allreduce(tensor, *args, **kwargs)

    def traced_grouped(tensors, *args, **kwargs):
        if tracker.call_stack() and not session.disabled and tensors:
            name = kwargs.get("name", args[0] if args else None)
            session.guard("recording Horovod's all-reduce", tracker.traced_allreduce, list(tensors),
                          _op_name("HorovodGroupedAllreduce", list(tensors), name))
        return grouped(tensors, *args, **kwargs)

    hvd_tf._allreduce = traced_allreduce
    hvd_tf._grouped_allreduce = traced_grouped
    patch_step_functions(tracker)
    return tracker


def horovod_tf_running() -> bool:
    hvd = sys.modules.get("horovod.tensorflow")
    try:
        return hvd is not None and hvd.is_initialized() and hvd.size() > 1
    except Exception:
        return False


def calibrate_horovod_tf(reps: int = 5) -> list[list[float]]:
    """Timed eager `hvd.allreduce` calls of the calibration sizes through horovod.tensorflow, each after an
    all-reduce of one float that lines the workers up: [[bytes, median µs, median transport CPU µs], ...] as for
    horovod.torch jobs (runtime/calibration.py)."""
    import horovod.tensorflow as hvd
    import tensorflow as tf

    from dprorun.runtime.calibration import _timed_sizes

    def line_up(nbytes: int, k: int) -> None:
        hvd.allreduce(tf.zeros((1,)), name=f"dprorun.calibration.barrier.{nbytes}.{k}", op=hvd.Sum).numpy()

    def call(tensor) -> None:
        hvd.allreduce(tensor, name=f"dprorun.calibration.{int(tensor.shape[0]) * 4}", op=hvd.Sum).numpy()

    return _timed_sizes(line_up, call, "cpu", reps, make=lambda count: tf.zeros((count,), tf.float32))
