"""Hooks in a TensorFlow MultiWorkerMirroredStrategy worker (`dprorun --backend tf`), with no change to the script.

Training steps: a `tf.function` whose tracing calls `strategy.run` (a custom loop's `train_step`, tf-keras
`Model.fit`'s `train_function`) is a step function; each call of it is one iteration (start and end taken around
the call, which returns when the step has run), unless it all-reduces nothing while another step function does
(gradient accumulation: its calls join the iteration the next syncing call ends; `run_step`). A script that calls
`strategy.run` eagerly, outside any tf.function, has each such call as its iteration.
Communication: `CollectiveReplicaLauncher.batch_all_reduce` is patched to record, while a step function is
traced, the packs the strategy all-reduces (each pack's gradient tensors, their bytes) and the pack size asked for
(`CommunicationOptions(bytes_per_pack)`); the per-step timing of every pack's `CollectiveReduceV2` comes from the
profiler.
Profiler: `tf.profiler.experimental.start/stop` over the window's first --kineto-iters iterations (no step
markers: see run_step); the XSpace file is moved to `rank_<r>/xplane.pb` (trace/xplane.py reads it).
"""
from __future__ import annotations

import functools
import glob
import os
import shutil
import sys
import threading
from typing import TYPE_CHECKING, Optional

from dprorun.layout import TF_PROFILER_STOP_MARK, XPLANE_FILE
from dprorun.runtime.script_profiler import ProfilerBusy, tf_busy, watch_tf
from dprorun.runtime.turns import StepTurns

if TYPE_CHECKING:
    from dprorun.runtime.session import RankSession


class TFTracker:
    """One per worker: the step functions seen, the packs traced, the profiler."""

    framework = "tf"

    def __init__(self, session: "RankSession"):
        self.session = session
        self.step_functions: set[int] = set()  # keys (`key`) of tf.function objects whose tracing called strategy.run
        # keys of the step functions whose tracing met the all-reduce: where some step functions do not (gradients
        # accumulated over micro-batches, all-reduced and applied by another), an iteration runs from the first
        # call after a syncing one to the end of the next syncing one
        self.syncing_functions: set[int] = set()
        # keys of the step functions whose tracing trains: computes gradients (GradientTape.gradient) or updates a
        # trainable float variable through the strategy (an optimizer's apply_gradients). A function that runs
        # strategy.run without either evaluates (tf-keras's test_function, whose metrics all-reduce too): its
        # calls are no iterations, and the iteration they fall in is disturbed
        self.training_functions: set[int] = set()
        self.running_step: Optional[int] = None  # the step function whose strategy.run is being traced now
        self.boundary_due = True  # the next step-function call starts an iteration
        self.local = threading.local()
        # per step function (its key; None: an eager strategy.run), the packs its first tracing all-reduced:
        # [{"tensors": [...], "bytes": [...], "call": n, "collective": op name}], `call` numbering the tracing's
        # all-reduce calls (an optimizer's apply_gradients makes one; a loss reduced after it, a synchronized
        # BatchNorm's moments, Keras's metrics make others)
        self.packs_by_function: dict[Optional[int], list[dict]] = {}
        # per step function, its all-reduce calls followed by an update of trainable variables (gradients applied):
        # call -> the names of the variables updated
        self.applied_calls: dict[Optional[int], dict[int, set[str]]] = {}
        # while a step function is traced: (its key, its tracing's last all-reduce call, that tracing's graph)
        self.recording: Optional[tuple[Optional[int], int, int]] = None
        self.called_syncing: set[int] = set()  # the syncing step functions called so far
        self.turns = StepTurns()  # syncing step functions taking turns within a step (a GAN's two models)
        self.traced_in_phase: dict[int, str] = {}  # syncing training step function -> the phase it was traced in
        self.window_function: Optional[int] = None  # the syncing step function the window's steps called
        self.next_key = 1
        self.bytes_per_pack: Optional[int] = None
        self.eager_steps = False
        self.in_step = False
        self.profiler_dir = os.path.join(session.rank_dir, "tf_profile")
        self.profiling = False
        self.strategy = None  # the strategy whose run() the steps call (for the calibration)
        self.calibrating = False  # the calibration's own tf.function and strategy.run pass through
        session.trackers.append(self)

    def key(self, function) -> int:
        """A step function's key: a serial number kept on the tf.function object (an id() is reused once its object
        is freed: Keras's compile() drops the old train_function, and the new one can get the same address)."""
        key = getattr(function, "_dpro_key", None)
        if key is None:
            key, self.next_key = self.next_key, self.next_key + 1
            try:
                function._dpro_key = key
            except AttributeError:  # an object that takes no attribute
                return id(function)
        return key

    @property
    def packs(self) -> list[dict]:
        """The gradient packs of the step function the window ran (or of the first one traced): those of its
        all-reduce calls whose results updated trainable variables (two optimizers: two calls), else of its first
        all-reduce call (gradients all-reduced by hand and assigned). A call updating only variables an earlier one
        did is the same step traced again in the function (tf-keras's steps_per_execution traces the first step,
        then the loop of the others): its packs are the earlier's."""
        function = self.window_function if self.window_function in self.packs_by_function else \
            next(iter(self.packs_by_function), None)
        packs = self.packs_by_function.get(function, [])
        updated: set[str] = set()
        kept = set()
        for call, variables in sorted(self.applied_calls.get(function, {}).items()):
            if not variables <= updated:
                kept.add(call)
            updated |= variables
        return [p for p in packs if p.get("call", 0) in (kept or {0})]

    def applied(self, variable: str) -> None:
        """The function being traced updated a trainable variable: its last all-reduce call carried gradients."""
        if self.recording is not None and not self.calibrating:
            function, call, _ = self.recording
            self.applied_calls.setdefault(function, {}).setdefault(call, set()).add(variable)

    def describe(self) -> dict:
        calls = sorted({p.get("call", 0) for p in self.packs})
        return {"framework": "tf", "backend": "tf-collective", "step_functions": len(self.step_functions),
                "eager_steps": self.eager_steps, "bytes_per_pack": self.bytes_per_pack,
                "packs": [{"tensors": list(p["tensors"]), "bytes": list(p["bytes"]),
                           "call": calls.index(p.get("call", 0)), "collective": p.get("collective")}
                          for p in self.packs]}

    # ---- steps -------------------------------------------------------------------------------------------
    def is_step(self, key: int) -> bool:
        """A training step function (its calls are iterations)."""
        return key in self.step_functions and key in self.training_functions

    def trains(self) -> None:
        """The step function being traced computes or applies gradients."""
        if self.running_step is not None and not self.calibrating:
            self.training_functions.add(self.running_step)

    def evaluated(self, key: int) -> None:
        """An evaluating step function's call (outermost) ran inside the current iteration, which it slowed."""
        session = self.session
        if key in self.step_functions and not self.is_step(key) and session.phase in ("active", "clean"):
            disturbed = session.records.disturbed_iterations
            if session.iteration not in disturbed:
                disturbed.append(session.iteration)

    def check_strategy(self, strategy) -> None:
        """A strategy that synchronises nothing across workers (MirroredStrategy, OneDeviceStrategy: local to a
        worker) makes N separate trainings of N workers, profiled as if they were one job: said once."""
        from tensorflow.python.distribute.collective_all_reduce_strategy import CollectiveAllReduceStrategy

        if self.session.world_size > 1 and not isinstance(strategy, CollectiveAllReduceStrategy):
            self.session.records.warnings.append(
                f"the script's strategy is {type(strategy).__name__}, which synchronises nothing across workers: "
                f"the {self.session.world_size} workers train separately (nothing of theirs is all-reduced); "
                "tf.distribute.MultiWorkerMirroredStrategy trains one model across them")

    def traced(self, key: int) -> None:
        """An outermost call of a function that is no known step yet returned: where it was the first (tracing)
        call of a syncing training step, note when (_first_call_of) and count it among the turns."""
        if self.is_step(key) and key in self.syncing_functions and key not in self.traced_in_phase:
            self.traced_in_phase[key] = self.session.phase
            self.turns.called(key, False)

    def call_stack(self) -> list:
        stack = getattr(self.local, "stack", None)
        if stack is None:
            stack = self.local.stack = []
        return stack

    def run_step(self, call, *args, **kwargs):
        """A call of a step function: the iteration boundary before it where one is due, its span after it. An
        iteration ends with a call of a syncing step function (every call, where none is known: an eager
        strategy.run, or before the syncing one was traced); micro-batch calls before it belong to it."""
        session = self.session
        if self.in_step:  # a step function called from inside a step: one iteration
            return call(*args, **kwargs)
        function = args[0] if args else None
        key = self.key(function)
        syncing = not self.syncing_functions or key in self.syncing_functions
        known = key in self.called_syncing
        began = self.boundary_due and (key not in self.syncing_functions or self.turns.begins(key))
        if began:
            session.begin_iteration()
        self.boundary_due = syncing
        start = session.now_us()
        self.in_step = True
        try:
            # no tf.profiler.experimental.Trace step markers around the profiled steps: with them, 3 of 12 plain
            # TensorFlow launches (no dprorun) that started and stopped the profiler crashed (SIGSEGV, SIGBUS,
            # SIGABRT) at the stop, none of 8 without; the step boundaries come from these hooks' own times
            return call(*args, **kwargs)
        finally:
            self.in_step = False
            if session.detail_active:
                session.mark("step", start, session.now_us())
            if not known and key in self.syncing_functions:  # a syncing step function's first call
                self.boundary_due = True  # its tracing showed it all-reduces: the iteration ends with it
                self._first_call_of(key)
            if key in self.syncing_functions:
                self.turns.called(key, began)
            if session.detail_active and key in self.syncing_functions:
                self.window_function = key

    def _first_call_of(self, function: int) -> None:
        """A syncing step function called for the first time (its tracing met the all-reduce). One that comes
        after others were called from the window on is another model's step (Keras's compile() makes a new
        train_function: fine-tuning after training the head): the window or the clean iterations end there
        (`RankSession.primary_replaced`), the iteration this call began being the new model's first. One traced
        before the window is none (a GAN's generator, traced in the first step: its first call after the trace can
        fall on the window's first iteration)."""
        session = self.session
        seen_before = bool(self.called_syncing)
        self.called_syncing.add(function)
        traced_in = self.traced_in_phase.get(function, "active")  # before the window: a GAN's second model
        if seen_before and session.phase in ("active", "clean") and traced_in in ("active", "clean"):
            session.guard("ending the window at the new step function", session.primary_replaced, session.iteration,
                          "model (a new step function that all-reduces: Keras's compile() makes one)")

    # ---- profiler ----------------------------------------------------------------------------------------
    def start_profiler(self) -> None:
        import tensorflow as tf

        if tf_busy(self.session.script_profiler):
            raise ProfilerBusy(self.session.script_profiler.name)
        shutil.rmtree(self.profiler_dir, ignore_errors=True)
        os.makedirs(self.profiler_dir, exist_ok=True)
        tf.profiler.experimental.start(self.profiler_dir)
        self.profiling = True

    def stop_profiler(self, write: bool) -> None:
        import tensorflow as tf

        if not self.profiling:
            return
        self.profiling = False
        mark = os.path.join(self.session.rank_dir, TF_PROFILER_STOP_MARK)
        try:  # a worker that dies in the stop leaves the mark: the launcher then knows where it died
            with open(mark, "w"):
                pass
        except OSError:
            mark = ""
        try:
            self._test_stop_crash()
            tf.profiler.experimental.stop(save=write)
        finally:
            if mark:
                os.remove(mark)
        files = sorted(glob.glob(os.path.join(self.profiler_dir, "plugins", "profile", "*", "*.xplane.pb")))
        if write and files:
            final = os.path.join(self.session.rank_dir, XPLANE_FILE)
            os.replace(files[-1], final)
            os.chmod(final, 0o600)
            self.session.records.files_written.append(XPLANE_FILE)
        elif write:
            self.session.records.warnings.append("the TensorFlow profiler wrote no .xplane.pb file")
        shutil.rmtree(self.profiler_dir, ignore_errors=True)

    def _test_stop_crash(self) -> None:
        """Test knob "tf-stop-crash:N": worker 1 aborts here in launch attempts 1..N, as TensorFlow's stop does
        now and then (see launch.relaunch_after_tf_stop_crash)."""
        fault = self.session.cfg.test_fault
        if fault.startswith("tf-stop-crash:") and self.session.rank == 1 and \
                self.session.cfg.launch_attempt <= int(fault.split(":", 1)[1]):
            os.abort()

    def step(self) -> None:  # torch.profiler's step(): the step markers are the Trace contexts of run_step
        return None

    def stop_param_hooks(self) -> None:  # the session's end of the detailed tier (nothing per parameter here)
        return None

    def detail_tier_started(self) -> None:
        return None

    def window_stopped(self) -> None:
        return None


def names_and_bytes(tensors) -> tuple[list[str], list[int]]:
    """The graph tensors' names and byte sizes, as traced (an unknown shape counts 0 bytes)."""
    names, sizes = [], []
    for tensor in tensors:
        count = tensor.shape.num_elements()
        names.append(getattr(tensor, "name", f"t{len(names)}"))
        sizes.append(int(count or 0) * int(tensor.dtype.size))
    return names, sizes


def _record_packs(tracker: TFTracker, packs, options) -> Optional[list[dict]]:
    """At trace time: the packs of each all-reduce call a step function's first call traces (an eager
    strategy.run: its first call's), per step function; the new packs, to be named by their collective ops. A
    first call that traces the function twice (tf.function does where the first tracing creates variables: an
    optimizer's slots) runs the last tracing, whose packs replace the earlier's."""
    stack = tracker.call_stack()
    function = tracker.key(stack[0]) if stack else None
    if tracker.calibrating:
        return None
    tracing = _outermost_graph() if function is not None else 0
    if function not in tracker.packs_by_function or (
            tracker.recording is not None and tracker.recording[0] == function and tracker.recording[2] != tracing):
        tracker.packs_by_function[function] = []
        tracker.applied_calls.pop(function, None)
        tracker.recording = (function, -1, tracing) if function is not None else None
    elif tracker.recording is None or tracker.recording[0] != function:
        return None  # traced again by a later call (another input signature): its first call's packs stand
    call = tracker.recording[1] + 1 if tracker.recording is not None else 0
    if tracker.recording is not None:
        tracker.recording = (function, call, tracing)
    recorded = [dict(zip(("tensors", "bytes"), names_and_bytes(pack)), call=call) for pack in packs]
    tracker.packs_by_function[function] += recorded
    if call == 0:
        bytes_per_pack = getattr(options, "bytes_per_pack", None)
        tracker.bytes_per_pack = int(bytes_per_pack) if bytes_per_pack is not None else None
    return recorded


def _outermost_graph() -> int:
    """The id of the function graph a tracing builds (a loop's or a branch's graph lies inside it)."""
    from tensorflow.python.framework import ops

    graph = ops.get_default_graph()
    while getattr(graph, "outer_graph", None) is not None and getattr(graph.outer_graph, "building_function", False):
        graph = graph.outer_graph
    return id(graph)


def _graph_size() -> Optional[int]:
    """The number of ops in the function graph being traced (None outside one)."""
    from tensorflow.python.framework import ops

    graph = ops.get_default_graph()
    return len(graph.get_operations()) if getattr(graph, "building_function", False) else None


def _name_collectives(recorded: list[dict], ops_before: int) -> None:
    """Each recorded pack's collective op (one per pack, in the packs' order), by its name in the function graph:
    the profile names it so (trace/tf_records.py picks the packs' all-reduces by it)."""
    from tensorflow.python.framework import ops

    created = ops.get_default_graph().get_operations()[ops_before:]
    collectives = [op.name for op in created if op.type.startswith("CollectiveReduce")]
    if len(collectives) == len(recorded):
        for pack, name in zip(recorded, collectives):
            pack["collective"] = name


def patch_tensorflow(session: "RankSession") -> TFTracker:
    """Patch the step detection, the pack recording and the session's profiler (see the module doc)."""
    from tensorflow.python.distribute import cross_device_utils, distribute_lib

    tracker = TFTracker(session)
    session.profiler_backend = tracker
    session.framework = "tf"
    session.guard("watching the script's profiler", watch_tf, session)
    strategy_run = distribute_lib.StrategyBase.run
    batch_all_reduce = cross_device_utils.CollectiveReplicaLauncher.batch_all_reduce

    def run(self, fn, args=(), kwargs=None, options=None):
        if tracker.calibrating:
            return strategy_run(self, fn, args, kwargs, options)
        if tracker.strategy is None:
            session.guard("checking the script's strategy", tracker.check_strategy, self)
        tracker.strategy = self
        stack = tracker.call_stack()
        if stack:  # inside a tf.function being traced: that function is a step function
            key = tracker.key(stack[0])
            tracker.step_functions.add(key)
            outer, tracker.running_step = tracker.running_step, key
            try:
                return strategy_run(self, fn, args, kwargs, options)
            finally:
                tracker.running_step = outer
        if not session.disabled and session.phase != "done":
            tracker.eager_steps = True
            return tracker.run_step(strategy_run, self, fn, args, kwargs, options)
        return strategy_run(self, fn, args, kwargs, options)

    def traced_batch_all_reduce(self, input_tensor_packs, options=None):
        recorded = session.guard("recording the all-reduce packs", _record_packs, tracker, input_tensor_packs,
                                 self._options.merge(options))
        stack = tracker.call_stack()
        if stack and not tracker.calibrating:
            tracker.syncing_functions.add(tracker.key(stack[0]))
        ops_before = session.guard("counting the traced ops", _graph_size) if recorded else None
        reduced = batch_all_reduce(self, input_tensor_packs, options)
        if ops_before is not None:
            session.guard("naming the all-reduce packs", _name_collectives, recorded, ops_before)
        return reduced

    _apply_pack_size(session)
    _watch_training(tracker)
    session.guard("watching for a parameter-server strategy", _watch_ps_strategy, session)
    patch_step_functions(tracker)
    distribute_lib.StrategyBase.run = run
    cross_device_utils.CollectiveReplicaLauncher.batch_all_reduce = traced_batch_all_reduce
    return tracker


PS_STRATEGY_WARNING = ("the script builds tf.distribute's ParameterServerStrategy (a coordinator dispatching steps to "
                       "workers, variables on ps tasks): dprorun --backend tf launches MultiWorkerMirroredStrategy "
                       "workers, whose TF_CONFIG holds workers only (no chief, no ps), so such a job cannot run under "
                       "it; a parameter-server job runs under dprorun as MXNet's kvstore (--backend mxnet)")


def _watch_ps_strategy(session: "RankSession") -> None:
    """Say why a ParameterServerStrategy script fails under --backend tf (TensorFlow's own error is "There must be at
    least one ps."): a warning recorded as the strategy is built, before TensorFlow refuses the cluster."""
    from tensorflow.python.distribute import parameter_server_strategy_v2

    cls = parameter_server_strategy_v2.ParameterServerStrategyV2
    init = cls.__init__

    @functools.wraps(init)
    def warned_init(self, *args, **kwargs):
        if PS_STRATEGY_WARNING not in session.records.warnings:
            session.records.warnings.append(PS_STRATEGY_WARNING)
        return init(self, *args, **kwargs)

    cls.__init__ = warned_init


def _watch_training(tracker: TFTracker) -> None:
    """What tells a training step function from an evaluating one while it is traced (TFTracker.trains):
    GradientTape.gradient (from any thread: replica functions may run on the strategy's), and the strategy's
    extended.update of a trainable float variable (an optimizer applying gradients it did not compute, as a
    gradient-accumulation step's apply function does; the step counters Keras updates are int64)."""
    from tensorflow.python.distribute import distribute_lib
    from tensorflow.python.eager import backprop

    gradient = backprop.GradientTape.gradient
    update = distribute_lib.StrategyExtendedV2.update

    @functools.wraps(gradient)
    def traced_gradient(self, *args, **kwargs):
        tracker.trains()
        return gradient(self, *args, **kwargs)

    @functools.wraps(update)
    def traced_update(self, var, *args, **kwargs):
        if getattr(var, "trainable", False) and getattr(getattr(var, "dtype", None), "is_floating", False):
            tracker.trains()
            tracker.applied(str(getattr(var, "name", id(var))))
        return update(self, var, *args, **kwargs)

    backprop.GradientTape.gradient = traced_gradient
    distribute_lib.StrategyExtendedV2.update = traced_update


def patch_step_functions(tracker: TFTracker) -> None:
    """tf.function calls: a call of a step function (one whose tracing met the job's all-reduce) from outside any
    tf.function is one iteration; the others are kept on a per-thread stack while they run (and are traced), so
    that the all-reduce patch knows which outermost function it is traced into."""
    from tensorflow.python.eager.polymorphic_function import polymorphic_function

    session = tracker.session
    function_call = polymorphic_function.Function.__call__

    def call(self, *args, **kwargs):
        if session.disabled or session.phase == "done" or tracker.calibrating:
            return function_call(self, *args, **kwargs)
        stack = tracker.call_stack()
        key = tracker.key(self)
        if not stack and tracker.is_step(key):
            return tracker.run_step(function_call, self, *args, **kwargs)
        stack.append(self)
        try:
            return function_call(self, *args, **kwargs)
        finally:
            stack.pop()
            if not stack:
                tracker.recording = None  # the outermost call's tracing (if any) is over
                tracker.evaluated(key)
                tracker.traced(key)

    polymorphic_function.Function.__call__ = call


def _apply_pack_size(session: "RankSession") -> None:
    """A strategy's `tf_bytes_per_pack_mb` (dprorun --strategy / --autotune): MultiWorkerMirroredStrategy is
    built with that pack size in its CommunicationOptions, the script's other options kept."""
    wanted = session.strategy.tf_bytes_per_pack_mb if session.strategy is not None else None
    if wanted is None:
        return
    import tensorflow as tf
    from tensorflow.python.distribute import collective_all_reduce_strategy

    cls = collective_all_reduce_strategy.CollectiveAllReduceStrategy
    init = cls.__init__
    pack_bytes = int(wanted * (1 << 20))

    def patched(self, cluster_resolver=None, communication_options=None):
        given = communication_options or tf.distribute.experimental.CommunicationOptions()
        options = tf.distribute.experimental.CommunicationOptions(
            bytes_per_pack=pack_bytes, timeout_seconds=given.timeout_seconds, implementation=given.implementation)
        session.strategy_applied["tf_bytes_per_pack"] = pack_bytes
        init(self, cluster_resolver=cluster_resolver, communication_options=options)

    cls.__init__ = patched


CALIBRATION_SIZES = (4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20)
CALIBRATION_TIMEOUT_S = 60.0


def calibrate_tf(tracker: TFTracker, repeats: int = 5) -> list[list[float]]:
    """[[bytes, µs, CPU µs], ...]: the median time of `repeats` all-reduces of each size through the job's own strategy
    (and the process's CPU time meanwhile: the transport's work, which shares the cores the worker computes on)
    (one tf.function per size, traced and run once first), every worker at the same point (the end of the
    window). A collective timeout keeps a worker from waiting forever for one that is gone."""
    import statistics
    import time

    import tensorflow as tf

    strategy = tracker.strategy
    if strategy is None:
        return []
    options = tf.distribute.experimental.CommunicationOptions(timeout_seconds=CALIBRATION_TIMEOUT_S)

    def make_reduce(count: int):
        def replica():  # the tensor made inside the replica function: a strategy.run argument made outside
            # it is not placed on the worker ("destinations can not be empty")
            value = tf.zeros((count,), tf.float32)
            return tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, value, options=options)

        return tf.function(lambda: strategy.run(replica))

    rows = []
    tracker.calibrating = True
    try:
        for nbytes in CALIBRATION_SIZES:
            reduce = make_reduce(nbytes // 4)
            reduce()  # traced and run once
            times, cpu = [], []
            for _ in range(repeats):
                started, cpu_started = time.perf_counter(), time.process_time()
                reduce()
                times.append((time.perf_counter() - started) * 1e6)
                cpu.append((time.process_time() - cpu_started) * 1e6)  # every thread: the transport's work
            rows.append([nbytes, statistics.median(times), statistics.median(cpu)])
    finally:
        tracker.calibrating = False
    return rows


def tf_compute_threads() -> int:
    """The intra-op threads TensorFlow computes with (0 in its config means one per core)."""
    import tensorflow as tf

    threads = tf.config.threading.get_intra_op_parallelism_threads()
    if threads:
        return int(threads)
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def keras3_fit_message() -> str:
    return ("Keras 3 Model.fit under MultiWorkerMirroredStrategy fails upstream (keras-team/keras#20585); use "
            "tf-keras (scripts/install-tf, or pip install tf-keras --no-deps; TF_USE_LEGACY_KERAS=1 before "
            "TensorFlow is imported) or a custom training loop")


def patch_keras3_fit(session: "RankSession") -> None:
    """Keras 3's `fit` called under MultiWorkerMirroredStrategy: say once, before it runs, that it fails upstream
    and what to use instead (the call itself goes ahead unchanged)."""
    from keras.src.backend.tensorflow import trainer

    fit = trainer.TensorFlowTrainer.fit
    said = []

    def checked_fit(self, *args, **kwargs):
        if not said:
            import tensorflow as tf
            from tensorflow.python.distribute import collective_all_reduce_strategy

            if isinstance(tf.distribute.get_strategy(), collective_all_reduce_strategy.CollectiveAllReduceStrategy) \
                    or getattr(self, "_distribute_strategy", None) is not None:
                said.append(True)
                session.records.warnings.append(keras3_fit_message())
                if session.rank == 0:
                    print(f"[dprorun] warning: {keras3_fit_message()}", file=sys.stderr, flush=True)
        return fit(self, *args, **kwargs)

    trainer.TensorFlowTrainer.fit = checked_fit
