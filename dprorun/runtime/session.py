"""The per-rank profiling session: the phase machine (iteration counting, the profiling window, the end-of-window
work). What the rank records lives in its RankRecords (runtime/records.py); the files are written by
runtime/rank_files.py.

Phases, counted in training iterations seen by the primary DistributedDataParallel module:
  warm-up [0, W)        only the iteration start time is taken
  active  [W, W+K)      DDP buckets (enqueue, completion), forward/backward/update spans (cheap hooks);
                        for the first P of them [W, W+P) also torch.profiler and per-parameter gradient-ready
                        hooks: op-level compute and transmission spans cost 10-30 % per iteration, so they
                        are sampled, not kept on
  clean   [W+K, W+K+C)  iteration start times only: the job's own speed without any profiling
Writing the profiler trace (at W+P) and the end-of-window work at W+K (events written, clock probes,
calibration, traces gathered to rank 0's node) pause the rank inside one iteration; those iterations are listed
as disturbed and left out of every statistic. Nothing of dprorun's runs in the clean iterations after that:
the samplers are stopped and no file is written until they are over.
  done                  at W+K+C: the clean iterations' start times written (clean.json; rank 0 writes those of
                        ranks on other hosts, sent over the window's group); the hooks step aside
The end-of-window work runs before the script can tear its process group down: a script that ends (calls
`destroy_process_group`) inside the window or the clean iterations triggers what is still due right there; a
job that ends without that records why the work did not run. A failure anywhere in here disables the session
with a warning; it never raises into the training script.
"""
from __future__ import annotations

import os
import socket
import sys
import threading
import time
import traceback
import weakref
from typing import Any, Callable, Optional

from dprorun.config import ProfileConfig
from dprorun.fsutil import atomic_write_json, make_private_dir
from dprorun.layout import CLEAN_FILE, PRIMARY_REPLACED, SCRIPT_RAISED, STOPPED_BY_SIGTERM, rank_dir, \
    ranks_with_records
from dprorun.runtime import rank_files
from dprorun.runtime.cpubudget import cgroup_cpu_stat, process_cpu_s
from dprorun.runtime.records import RankRecords
from dprorun.runtime.steps import LeadingOptimizerSteps
from dprorun.runtime.script_profiler import ProfilerBusy, ScriptProfilerState, busy_message
from dprorun.runtime.log import warn
from dprorun.runtime.watch import ScriptUse, nothing_to_profile, read_subprocess_scripts


class RankSession:
    def __init__(self, cfg: ProfileConfig, rank: int, local_rank: int, world_size: int):
        self.cfg = cfg
        self.pid = os.getpid()  # a process forked from the rank (a data loader's worker) inherits this object
        self.rank = rank
        self.local_rank = local_rank
        self.world_size = world_size
        self.real_host = socket.gethostname()
        self.host = cfg.host_for(rank, self.real_host)
        self.skew_us = cfg.skew_for(rank)
        self.rank_dir = rank_dir(cfg.run_dir, rank)
        self.phase = "warmup"
        self.disabled = False
        self.iteration = -1
        self.records = RankRecords()  # the buffers behind events.json (runtime/records.py)
        self.trackers: list[Any] = []
        self.profiling_cut_at: Optional[int] = None  # see primary_replaced
        self.primary_forwards = 0  # training forwards of the primary DDP module (runtime/ddp.py)
        self.optimizers: list[weakref.ref] = []  # those stepped in the window, held weakly (a script frees them)
        self.script_use = ScriptUse()  # torch.distributed use outside the supported wrappers (runtime/watch.py)
        self.optimizer_steps = LeadingOptimizerSteps()  # the job's torch optimizer steps: DDP's iterations
        self.optimizer_step_hook: Optional[Any] = None
        self.script_use.timed = self._script_collective
        self.profiler = None  # the profiler backend while it records, else None
        self.script_profiler = ScriptProfilerState()  # the script's own profiler (runtime/script_profiler.py)
        self.hook_bytes: Optional[Any] = None  # what the script's own DDP comm hooks send (runtime/hook_bytes.py)
        # start_profiler() / stop_profiler(write) / step(): torch.profiler (runtime/torch_profiler.py) by default;
        # TensorFlow's and MXNet's hooks set their own (runtime/tf.py, runtime/mxnet.py)
        self.profiler_backend: Optional[Any] = None
        self.framework = "torch"  # "tf" in TensorFlow workers: no torch process group of the job's own
        self.window_hooks: list[Any] = []
        self.open_marks: dict[str, float] = {}
        self.wall_start_us = self.now_us()
        self.monotonic_at_start_ns = time.monotonic_ns()
        self.lock = threading.Lock()
        self.sampler = None
        self.window_start_us: Optional[float] = None
        self.window_end_us: Optional[float] = None
        self.window_stopped = False
        self.kineto_start_iteration = cfg.warmup  # where the profiler started: W, or later (script_profiler.py)
        self.kineto_end_iteration = -1  # first iteration after the profiler stopped (-1: it never ran)
        self.profiler_waiting = False  # due, but the script's own profiler was on: started once that stops
        self.gathered_hosts: list[str] = []  # every rank's host, as the gather saw them
        self.window_group = None  # the gloo group of the end-of-window work, kept for the clean exchange
        self.remote_ranks: list[int] = []  # rank 0: ranks whose files came over the network (other disks)
        self.window_work_done = False  # probes, calibration and gather ran (or were attempted)
        self.teardown_alone = False  # the group's teardown came with ranks missing: its collectives were skipped
        self.spawned_by_script = False  # a rank the script spawned itself (runtime/spawned.py)
        self.script_exit_status: Any = None  # what the script passed to sys.exit (runtime/raised.py)
        from dprorun.runtime import apply

        self.strategy, problem = apply.load()  # the optimizer's strategy this job runs with, if any
        self.strategy_applied: dict[str, Any] = {}
        if problem:
            self.records.warnings.append(problem)
        elif self.strategy is not None:
            self.records.warnings.extend(apply.not_applied_notes(self.strategy))

    # ---- clock -------------------------------------------------------------------------------------------
    def now_us(self) -> float:
        """Epoch microseconds on this rank's clock (shifted by the test skew knob, as every timestamp is)."""
        return time.time_ns() / 1000.0 + self.skew_us

    # ---- control -----------------------------------------------------------------------------------------
    @property
    def detail_active(self) -> bool:
        return self.phase == "active" and not self.disabled

    def disable(self, reason: str) -> None:
        """Turn profiling off, keeping what was recorded if it can be written. Never raises: this is what the
        hooks fall back on when something failed (a full disk, a broken profiler)."""
        if not self.disabled:
            self.disabled = True
            self.records.warnings.append(reason)
            try:
                warn(f"profiling disabled, training continues: {reason}", self.rank)
                self._stop_window(write=True)
            except Exception as exc:  # e.g. the disk is full: the trace is lost, the training is not
                self.records.warnings.append(f"the trace could not be kept: {type(exc).__name__}: {exc}")

    def guard(self, what: str, fn: Callable, *args) -> Any:
        """Run fn; on any exception disable profiling instead of disturbing training."""
        try:
            return fn(*args)
        except Exception as exc:
            self.disable(f"{what} failed: {type(exc).__name__}: {exception_text(exc)}\n"
                         f"{traceback.format_exc(limit=3)}")
            return None

    # ---- iteration boundaries ----------------------------------------------------------------------------
    def begin_iteration(self) -> None:
        now = self.now_us()
        self._close_mark("update", now)
        self.iteration += 1
        self.script_exit_status = None  # a sys.exit the script caught: it trains on
        self.records.add_iteration_start(now, process_cpu_s())
        if self.script_profiler.on:
            self.records.mark_script_profiled(self.iteration)
        if self.disabled or self.phase == "done":
            return
        if self.profiler is not None:
            self.profiler.step()  # ProfilerStep#N annotations, as Holistic Trace Analysis expects
        cfg = self.cfg
        if self.iteration in (cfg.warmup, cfg.warmup + cfg.kineto_iters, cfg.warmup + cfg.active,
                              cfg.warmup + cfg.active + cfg.clean):
            stat = cgroup_cpu_stat()  # the host's CPU quota: how often it held the job back (None: no quota)
            if stat is not None:
                self.records.host_cpu_stat.append([self.iteration, now, stat])
        if self.iteration == cfg.warmup and self.phase == "warmup":
            self.guard("starting the profiling window", self._start_window)
        elif self.iteration == cfg.warmup + cfg.active and self.phase == "active":
            self.records.disturbed_iterations.append(self.iteration)
            self._close_window_and_gather()
        elif self.phase == "active":
            self._detail_tier_step()
        if self.iteration == cfg.warmup + cfg.active + cfg.clean and self.phase == "clean":
            self.guard("writing the clean iterations", self._finish_clean, True)
            if cfg.dry_run and self.framework == "mxnet":
                # an MXNet worker that leaves from inside Trainer.step can hang the kvstore's shutdown (its
                # destructor runs at interpreter teardown: seen once in a clean-clone CI run, every role waiting):
                # the workers finish the job, the prediction comes at its end as under --dry-run
                if self.rank == 0:
                    print("[dprorun] dry run: the window is done; MXNet workers run the job to its end (leaving "
                          "early can hang the kvstore's shutdown)", file=sys.stderr, flush=True)
            elif cfg.dry_run:  # every rank is here at the same iteration: leave together, cleanly
                print(f"[dprorun] dry run: rank {self.rank} stops after the profiling window", file=sys.stderr,
                      flush=True)
                raise SystemExit(0)

    def _detail_tier_step(self) -> None:
        """Inside the window: the detailed tier ends P iterations after it started (at W, or later where the
        script's own profiler held it back: then at the first iteration after the script's stopped that leaves P of
        them before the window's end); the cheap hooks stay."""
        cfg = self.cfg
        if self.iteration == self.kineto_start_iteration + cfg.kineto_iters and not self.profiler_waiting:
            for tracker in self.trackers:
                tracker.stop_param_hooks()
            if self.profiler is not None:
                self.records.disturbed_iterations.append(self.iteration)
                self.guard("stopping the profiler", self._stop_profiler, True)
        elif self.profiler_waiting and not self.script_profiler.on and \
                self.iteration + cfg.kineto_iters < cfg.warmup + cfg.active:
            self.guard("starting the detailed tier", self._start_detail_tier)

    def _close_window_and_gather(self) -> None:
        """End of the active iterations: window closed, then the end-of-window work; the clean ones follow."""
        self.guard("closing the profiling window", self._stop_window, True)
        self.phase = "clean"
        if not self.disabled:  # a rank whose profiling failed (e.g. a full disk) stays out, as every rank does then
            self.guard("gathering traces", self._finish_window)

    def before_group_teardown(self) -> None:
        """The script is destroying its default process group (or shutting Horovod down): whatever end-of-window
        work is still due runs now, while the ranks can still talk (they all call this at the same point)."""
        if self.disabled or self.phase in ("warmup", "done"):
            return  # profiling off, the window never started, or everything already ran
        from dprorun.runtime.gather import ranks_meet_at_teardown

        alone = self.guard("meeting the other ranks at the group's teardown", ranks_meet_at_teardown, self)
        if alone:  # at_exit keeps what was recorded, with no collective
            self.teardown_alone = True
            self.records.warnings.append(alone)
            warn(alone, self.rank)
            return
        if self.phase == "active":
            self.records.warnings.append(f"the script tore its process group down at iteration {self.iteration}, "
                                         f"inside the profiling window (iterations {self.cfg.warmup}-"
                                         f"{self.cfg.warmup + self.cfg.active - 1}): the window was closed there")
            self._close_window_and_gather()
        if self.phase == "clean":
            self.guard("writing the clean iterations", self._finish_clean, True)

    def wrapper_built(self, what: str) -> None:
        """The script built a wrapper the hooks profile (`what`: a DDP module, an hvd.DistributedOptimizer): a
        tracker of the script's own all-reduces (runtime/collectives.py) hands the job over to the wrapper's."""
        for tracker in [t for t in self.trackers if getattr(t, "framework", "") == "collectives"]:
            tracker.wrapper_built(what)

    def primary_replaced(self, first_new: int, what: str, set_up_before: bool = True) -> None:
        """The script went on to train another model (`what`), from iteration `first_new` on, inside the window or
        the clean iterations (all ranks do, at the same iteration): the window closes there and the clean
        iterations end, the run's reference being the model the window profiled. `set_up_before`: the iteration
        before `first_new` ends with the new model's set-up (disturbed; Horovod's iterations end at each step, so
        the set-up falls in `first_new` itself)."""
        if self.disabled or self.phase == "done":
            return
        cfg = self.cfg
        clean_start, last_old = cfg.warmup + cfg.active, first_new - 1
        if first_new < clean_start:
            where = (f"inside the profiling window (iterations {cfg.warmup}-{clean_start - 1}): the window was closed "
                     "there, and none of its model's iterations ran without profiling (the run's reference)")
        elif last_old > clean_start:
            where = (f"after {last_old - clean_start} of the {cfg.clean} iterations timed without profiling: "
                     "the run's reference rests on those")
        else:
            where = f"before the {cfg.clean} iterations timed without profiling: the run has no reference"
        self.records.warnings.append(
            f"{PRIMARY_REPLACED}{what} at iteration {first_new}, {where}; profile one model's "
            "training with --warmup (or more steps before the switch)")
        if set_up_before:
            self.records.disturbed_iterations.append(last_old)
        self.profiling_cut_at = first_new
        if self.phase == "active":
            self._close_window_and_gather()
        if self.phase == "clean":
            self.guard("writing the clean iterations", self._finish_clean, True)

    def _script_collective(self, name: str, us: float) -> None:
        """A collective the script called itself returned (runtime/watch.py): kept for the window's iterations,
        unless its own DDP comm hook made it (a bucket's all-reduce, in the buckets' records)."""
        if self.phase != "active" or self.disabled:  # the common case outside the window: nothing to look up
            return
        if self.hook_bytes is None or not self.hook_bytes.from_hook():
            self.records.add_script_collective(self.iteration, name, us)

    def mark(self, name: str, start_us: float, end_us: float, iteration: Optional[int] = None) -> None:
        self.records.spans.append([self.iteration if iteration is None else iteration, name, start_us, end_us])

    def open_mark(self, name: str) -> None:
        self.open_marks[name] = self.now_us()

    def _close_mark(self, name: str, now: float) -> None:
        start = self.open_marks.pop(name, None)
        if start is not None and self.detail_active:
            self.mark(name, start, now)

    # ---- window ------------------------------------------------------------------------------------------
    def _start_window(self) -> None:
        make_private_dir(self.rank_dir)
        # the job's own peak so far (warm-up iterations), before any profiler buffer exists
        peak = rank_files.peak_rss_bytes()
        if peak is not None:
            self.records.memory["max_rss_before_window_bytes"] = peak
        self.phase = "active"
        self.window_start_us = self.now_us()
        if self.rank == 0:  # progress: one line per phase, from rank 0 only
            cfg = self.cfg
            profiler = {"tf": "the TensorFlow profiler", "mxnet": "mx.profiler"}.get(self.framework, "torch.profiler")
            print(f"[dprorun] profiling iterations {cfg.warmup}-{cfg.warmup + cfg.active - 1} ({profiler} in the "
                  f"first {cfg.kineto_iters if cfg.kineto else 0})", file=sys.stderr, flush=True)
        if self.framework == "torch":
            self._register_optimizer_hooks()
        self._start_detail_tier()

    def _start_detail_tier(self) -> None:
        """The detailed tier from this iteration on, for P of them: the profiler, the per-parameter hooks and the
        module scopes; held back while the script's own profiler is on (_detail_tier_step tries again)."""
        if self.cfg.kineto and self.cfg.kineto_iters > 0 and not self._start_profiler():
            return
        self.kineto_start_iteration = self.iteration
        for tracker in self.trackers:
            tracker.detail_tier_started()

    def _start_profiler(self) -> bool:
        """The framework's profiler for the detailed tier's --kineto-iters iterations: torch.profiler
        (runtime/torch_profiler.py) unless the framework's hooks set their own (TensorFlow's, MXNet's). False where
        the script's own profiler is on (ProfilerBusy): dprorun's is then due again once the script's stops."""
        if self.profiler_backend is None:
            from dprorun.runtime.torch_profiler import TorchProfiler

            self.profiler_backend = TorchProfiler(self)
        try:
            with self.script_profiler.own_calls():
                self.profiler_backend.start_profiler()
        except ProfilerBusy:  # tried again once the script's stops (_detail_tier_step)
            self.profiler_waiting = True
            return False
        if self.profiler_waiting:
            self._note(f"the script's own {self.script_profiler.name} was on when dprorun's profiler was due "
                       f"(iteration {self.cfg.warmup}): dprorun's ran from iteration {self.iteration}, after the "
                       "script's stopped")
        self.profiler_waiting = False
        self.profiler = self.profiler_backend
        return True

    def _note(self, message: str) -> None:
        """A warning for the summary, said on this rank's output too."""
        self.records.warnings.append(message)
        warn(message, self.rank)

    # ---- the script's own profiler (runtime/script_profiler.py) -------------------------------------------
    def script_profiler_started(self) -> None:
        """The script turned its own profiler on: dprorun's stops first if it records (keeping the iterations it
        profiled in full); this iteration and those up to its stop are marked as run under the script's."""
        self.records.mark_script_profiled(self.iteration)
        self._yield_profiler("started its own")

    def script_profiler_configured(self) -> None:
        """The script configured its own profiler (mx.profiler.set_config: the process's one configuration)."""
        self._yield_profiler("configured its own")

    def script_profiler_stopped(self) -> None:
        self.records.mark_script_profiled(self.iteration)

    def _yield_profiler(self, what: str) -> None:
        if self.profiler is None or self.disabled:
            return
        kept = self.iteration - self.kineto_start_iteration  # iterations that ran under dprorun's in full
        self.guard("stopping the profiler", self._stop_profiler, kept > 0)
        if kept:
            plural = "s" if kept > 1 else ""
            self._note(f"the script {what} {self.script_profiler.name} at iteration {self.iteration}, while "
                       f"dprorun's recorded: dprorun's stopped there ({kept} profiled iteration{plural} kept)")
        else:  # nothing profiled yet: the detailed tier starts again once the script's stops, if the window has room
            for tracker in self.trackers:
                tracker.stop_param_hooks()
            self.profiler_waiting = True
            self.kineto_end_iteration = -1

    def count_optimizer_steps(self) -> None:
        """Count every torch optimizer step of the job from now on (a global post-hook, registered once; the steps
        of its most-stepped optimizer are the iterations': runtime/steps.py). Before the first step DDP's iterations
        begin at every synchronised forward (runtime/ddp.py); where the first step had several (two views,
        micro-batches without no_sync), they were one iteration: still in the warm-up, the count starts again."""
        if self.optimizer_step_hook is None:
            from torch.optim.optimizer import register_optimizer_step_post_hook

            def counted(optimizer, args, kwargs):
                self.optimizer_steps.step(id(optimizer))
                if self.optimizer_steps.total == 1 and self.phase == "warmup" and self.iteration > 0:
                    self.iteration = 0
                    self.records.keep_first_iteration()

            self.optimizer_step_hook = register_optimizer_step_post_hook(counted)

    def _register_optimizer_hooks(self) -> None:
        """The update span: optimizer.step's pre-hook to its post-hook. A step given a closure (Lightning's
        automatic optimization, LBFGS) runs the forward and backward inside that closure: its update starts when
        the closure returns (the closure is wrapped to mark it), not at the step's start, which the forward's new
        iteration would close at once (Lightning's Adam updates were read as 0.1 ms and their time as a gap)."""
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        def after_closure(closure):
            def closure_then_update(*a, **kw):
                result = closure(*a, **kw)
                if self.detail_active:
                    self.open_mark("update")
                return result
            return closure_then_update

        def pre(optimizer, args, kwargs):
            if self.detail_active:
                if not any(ref() is optimizer for ref in self.optimizers):
                    self.optimizers.append(weakref.ref(optimizer))
                if callable(kwargs.get("closure")):
                    return args, dict(kwargs, closure=after_closure(kwargs["closure"]))
                if len(args) > 1 and callable(args[1]):  # args[0] is the optimizer itself
                    return (args[0], after_closure(args[1]), *args[2:]), kwargs
                self.open_mark("update")
            return None

        def post(optimizer, args, kwargs):
            if self.detail_active:
                self._close_mark("update", self.now_us())

        self.window_hooks.append(register_optimizer_step_pre_hook(pre))
        self.window_hooks.append(register_optimizer_step_post_hook(post))

    def _stop_window(self, write: bool) -> None:
        if self.window_stopped:
            return
        self.window_stopped = True
        self.window_end_us = self.now_us()
        for handle in self.window_hooks:
            handle.remove()
        self.window_hooks.clear()
        for tracker in self.trackers:
            tracker.window_stopped()
        if self.profiler_waiting:  # the script's own profiler held dprorun's back for the whole window
            self.profiler_waiting = False
            self.script_profiler.refused_ours = True
            self._note(busy_message(self.script_profiler.name))
        rank_files.record_memory(self)
        self._stop_profiler(write)
        if write:
            self.write_events()

    def _stop_profiler(self, write: bool) -> None:
        profiler, self.profiler = self.profiler, None
        if profiler is not None:
            self.kineto_end_iteration = self.iteration
            with self.script_profiler.own_calls():
                profiler.stop_profiler(write)

    # ---- files -------------------------------------------------------------------------------------------
    def write_events(self) -> None:
        rank_files.write_events(self)
        if self.spawned_by_script and self.rank == 0:  # the launcher learns the job's world size from its rank 0
            from dprorun.runtime.spawned import say_the_world_size

            say_the_world_size(self.cfg.run_dir, self.world_size)

    def clean_document(self, rank: Optional[int] = None, starts: Optional[list[float]] = None,
                       complete: bool = True, script_marks: Optional[list[int]] = None) -> dict:
        return rank_files.clean_document(self, rank, starts, complete, script_marks)

    def _finish_window(self) -> None:
        """Stop the samplers, probe clock offsets, calibrate, write the events, ship remote ranks' files to rank
        0's node; rank 0 then times model variants if asked. All before the clean iterations."""
        from dprorun.runtime.gather import finish_job_window
        from dprorun.runtime.rng import script_random_state_kept

        if self.window_work_done:
            return
        self.window_work_done = True
        if self.sampler is not None:
            self.sampler.stop()
        with script_random_state_kept():  # seeded scripts draw what they draw under torchrun
            finish_job_window(self)
        if not self.cfg.measure_variants:
            return
        from dprorun.runtime.gather import hold_ranks_while_rank0_measures

        meet = self.guard("lining the ranks up for rank 0's compute variants", hold_ranks_while_rank0_measures, self)
        if self.rank == 0:
            tracker = next((t for t in self.trackers if hasattr(t, "ddp") and t.primary), None)
            if tracker is not None and tracker.model is not None:
                from dprorun.runtime.variants import measure_and_write

                self.guard("measuring compute variants", measure_and_write, self, tracker)
            elif self.framework == "torch":  # (TensorFlow's and MXNet's models: no torch variants to time)
                from dprorun.runtime.variants import variants_not_measured

                self.records.warnings.append(variants_not_measured(self.trackers))
        if meet is not None:
            self.guard("waiting for rank 0's compute variants", meet)

    def _finish_clean(self, exchange: bool) -> None:
        """After the clean iterations: write their start times, and (exchange) send them to rank 0 for the
        ranks whose files live on another disk; then the window's group is released."""
        if self.phase == "done":
            return
        self.phase = "done"
        complete = len(self.records.iteration_starts) > self.cfg.warmup + self.cfg.active + self.cfg.clean
        make_private_dir(self.rank_dir)
        atomic_write_json(os.path.join(self.rank_dir, CLEAN_FILE), self.clean_document(complete=complete))
        if exchange and self.window_work_done and (self.framework == "torch" or self.window_group is not None):
            from dprorun.runtime.gather import exchange_clean_starts

            exchange_clean_starts(self, complete)

    def at_exit(self) -> None:
        """Keep whatever was recorded: close the window if the job ended inside it and write the files. No
        collective here (the other ranks may be gone): what needed one and did not run is recorded as such. Not in
        a process forked from the rank (its copy of the records is stale, the files are the rank's)."""
        if os.getpid() != self.pid:
            return
        # a script that raised before its first step, or a rank the launcher stopped (a peer failed first): the
        # error says why nothing was profiled
        raised = any(isinstance(w, str) and (w.startswith(SCRIPT_RAISED) or w == STOPPED_BY_SIGTERM)
                     for w in self.records.warnings)
        # the only process launched, training nothing itself, whose records are there: the processes it started
        # were the job's ranks and wrote them (runtime/spawned.py)
        spawned_ranks = bool(self.world_size == 1 and not self.trackers and ranks_with_records(self.cfg.run_dir))
        # a process spawned for other work than training (no process group): the launched process speaks
        spawned_helper = self.spawned_by_script and not self.script_use.process_group
        if not self.trackers and self.rank == 0 and not self.disabled and not raised and not spawned_ranks \
                and not spawned_helper:
            self.script_use.subprocess_scripts = read_subprocess_scripts(self.rank_dir)
            warn(nothing_to_profile(self.script_use), self.rank)
        elif self.iteration < 0 and self.rank == 0 and not self.disabled and not raised and not spawned_ranks \
                and not spawned_helper:
            warn(no_step_seen(self.trackers), self.rank)
        if self.phase == "active" or (self.disabled and self.profiler is not None):
            self._stop_window(write=True)
            self.phase = "clean"
        if not (self.window_work_done or self.teardown_alone) and self.iteration >= self.cfg.warmup and \
                not self.disabled:
            self.records.warnings.append(
                f"the job ended at iteration {self.iteration} before the end of the profiling window "
                f"(iteration {self.cfg.warmup + self.cfg.active})" + (
                    f": no {'kvstore' if self.framework == 'mxnet' else 'all-reduce'} calibration ran"
                    if self.framework != "torch" else
                    " without tearing its process group down: no clock probes, calibration or gather ran "
                    "(offsets rest on the traces alone; ranks on other hosts kept their files)"))
        try:
            # a Horovod rank's records name its failure to the launcher (horovodrun's own words do not); a job that
            # ran to its end with nothing profiled leaves no records (the launcher says so, not an empty summary)
            if self.iteration >= 0 or self.trackers or (self.script_use.horovod_initialised and raised):
                self.write_events()
            if self.phase == "clean":
                self._finish_clean(exchange=False)
        except Exception as exc:
            warn(f"could not write the trace at exit: {exc}", self.rank)
        if self.sampler is not None:
            self.sampler.stop()


def exception_text(exc: BaseException) -> str:
    """An exception's message; for MXNet's errors, which carry the C++ traceback first and the cause last, the
    cause."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if len(lines) > 1 and lines[0].startswith("Traceback"):
        return lines[-1]
    return str(exc)


def no_step_seen(trackers: list) -> str:
    """A job whose hooks were installed but never saw a training step (what they need to see one)."""
    if any(getattr(t, "framework", "") == "horovod" and hasattr(t, "step_functions") for t in trackers):
        how = ("horovod.tensorflow's all-reduce was never traced inside a tf.function: steps run eagerly are not "
               "profiled; decorate the training step with @tf.function")
    elif any(getattr(t, "framework", "") == "tf" for t in trackers):
        how = "no tf.function step called strategy.run, and no strategy.run was called eagerly"
    else:
        how = "the training wrapper was built, but no step ran through it"
    return f"nothing to profile: the hooks saw no training step ({how}). The job ran unprofiled"
