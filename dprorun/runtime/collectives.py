"""Gradients shared by the script's own torch.distributed.all_reduce calls (no wrapper): the PyTorch tutorial's
`average_gradients` (one all-reduce per parameter after the backward), flat buffers all-reduced by hand, async_op
calls waited for before the step, calls from gradient hooks inside the backward (overlap by hand); horovod.torch's
own calls alike (hvd.allreduce, grouped_allreduce, their async forms waited for by hvd.synchronize, reducescatter and
allgather, with no DistributedOptimizer: runtime/gradient_calls.py). Nothing in the script changes.

The tracker watches from the moment torch.distributed and torch.autograd are imported, and takes part in the job only
where no supported wrapper does (no DDP module, no hvd.DistributedOptimizer) and an optimizer step followed
all-reduces called after or inside a backward pass that carried at least half the optimizer's gradient bytes: it
joins the session at such a step (`ScriptCollectivesTracker.step_returned`), and the job's iterations are counted from
there, one per step of its most-stepped optimizer (runtime/steps.py), as for Horovod: iteration k runs from the end
of step k-1 to the end of step k.
  - `torch.autograd.backward` (what loss.backward() calls) is timed: the backward of the step's first all-reduce
    (the last one before it, or the one it was called in) is the iteration's backward0; forward0 runs from the
    iteration's start to it (data, forward, loss, earlier micro-batches);
  - each such all_reduce before the step is one bucket of its own, named after the parameters whose gradients it
    carries (by address; a flat buffer by its bytes: the run of parameters in model order they add up to; else
    `all_reduce<k>`); a call on one parameter's gradient is that parameter's bucket in every step, any other the
    k-th call of its kind and bytes in the step (indices in order of first sight);
  - a call after the backward could start no earlier than the backward's end or the previous synchronous call's
    return: its record starts there (the script's own work between two calls, a per-parameter loop's division, is
    part of the call it delays); a call inside the backward starts at its own start, cutting the backward as DDP's
    buckets do; a synchronous call makes the job's collectives replay one at a time (`describe()["serial"]`);
  - a record ends when the call's Work completes (its future's callback): a synchronous call is made with
    async_op=True in the window and waited for at once (an NCCL call returns once enqueued on its stream); on gloo
    such a call ends at its wait's return (no Python callback on gloo's threads);
  - an optimizer sharded by hand (ZeRO): reduce-scatters are gradient calls as all-reduces are, and the all-gathers
    after such a step, before the next backward, are buckets after the update; the iteration ends once they returned
    (docs/architecture.md);
  - FSDP on the CPU (FSDP2's fully_shard over gloo): every call FSDP makes (the forward's and the backward's
    parameter gathers, the backward's gradient reduce-scatters) holds the calling thread until it is done, in
    program order: each is a bucket of its own, from its own start to its return, in call order
    (`describe()["blocking"]`: the replay takes their time out of the compute and makes the compute after each call
    wait for it); a bucket is the n-th call of its kind and bytes in the step, and an evaluation's gathers (a
    forward under no_grad) are buckets of their own in an iteration counted as an inference pass. On a GPU FSDP
    overlaps them on its own streams, which this does not model: such a job is not joined.
The update is the optimizer step's span (the session's hooks). The bucket layout is the script's: the optimizer
leaves it (replay/build.py) and says what one flat all-reduce or DDP would give (optimize/search.py)."""
from __future__ import annotations

import functools
import sys
from typing import Any, Optional

from dprorun.layout import CommRecord
from dprorun.runtime.gradient_calls import (GRADIENT_COLLECTIVES, HOROVOD_KINDS, KINDS, PARAMETER_GATHERS, HandleWorks,
                                             bucket_entry, covered, fsdp_blocks, gradient_bytes, group_size)
from dprorun.runtime.gradient_names import StepGradientNames
from dprorun.runtime.session import RankSession
from dprorun.runtime.steps import LeadingOptimizerSteps

# the share of the stepped optimizer's gradient bytes a step's all-reduces must carry for the job to be taken as one
# sharing its gradients (a loss or a metric all-reduced between backward and step, in a job whose ranks train apart,
# is not that)
SHARED_SHARE = 0.5
# compressed gradients all-gathered between the backward and the step (top-k values and indices, each rank's share):
# what they carried, as a share of the gradients' bytes, for the tracker to join on them (a top 0.1 % is 0.6 % at 2
# ranks; a loss gathered for logging is bytes)
GATHERED_SHARE = 0.005
# FSDP's gathers for a forward that trains nothing (an evaluation under no_grad) are keyed from here, apart from the
# step's calls: an iteration that has them keeps its other calls' keys (the step's place-in-order identities)
INFERENCE_CALL_BASE = 1_000_000
# a sharded step's parameter gathers are keyed from here, after every gradient call's bucket (those are numbered in
# order of first sight: the window may start at a step's gathers)
GATHER_CALL_BASE = 500_000


class ScriptCollectivesTracker:
    """One per process: the script's own gradient all-reduces, once it is seen to train so."""

    framework = "collectives"

    def __init__(self, session: RankSession):
        self.session = session
        self.joined = False
        self.primary = False
        self.steps = LeadingOptimizerSteps()
        self.step_hook: Optional[Any] = None
        self.backward: Optional[tuple[float, float]] = None  # the latest backward call since the step (start, end)
        self.in_backward: Optional[float] = None  # a backward call under way: its start
        # the backward of the step's first all-reduce: the one before it, or the one it was called in (end None until
        # that returns)
        self.step_backward: Optional[tuple[float, Optional[float]]] = None
        self.calls_in_step = 0  # gradient all-reduces since the last step
        self.inference_calls_in_step = 0  # FSDP's gathers since the last step for forwards that train nothing
        self.forward_trains = True  # the latest FSDP forward ran with autograd on (`_watch_fsdp_grad_mode`)
        # FSDP's buckets: (evaluating, call, bytes) and its n-th occurrence in a step -> bucket index (`_record_fsdp`)
        self.fsdp_keys: dict[tuple[tuple[bool, str, int], int], int] = {}
        self.fsdp_kinds_in_step: dict[tuple[bool, str, int], int] = {}
        # what the step's calls recorded (comm records, gradient-ready rows, new bucket keys): left out again where the
        # step ends no iteration (`_leave_out_step`)
        self.step_records: list[CommRecord] = []
        self.step_ready: list[tuple] = []
        self.step_new_keys: list[tuple[int, int]] = []
        self.optimizers_seen: set[int] = set()  # the optimizers whose trained models are among `roots`
        self.stepping: dict[int, int] = {}  # id(optimizer) -> its step's wrappers under way (`_stepped`)
        self.bytes_in_step = 0  # what they carried (before the tracker joined: is it the gradients?)
        self.next_ready_us = 0.0  # where the step's next call could have started (the previous one's return)
        self.iteration_start = 0.0
        self.serial = False  # a call waited for its all-reduce (no async_op): the calls ran one at a time
        self.asynchronous = False  # a call returned a Work (async_op=True)
        self.names = StepGradientNames(self.named_parameters)  # the step's gradients: whose a call carries
        self.roots: list = []  # the trained model(s): the outermost modules holding the optimizer's parameters
        self.scope_handles: list = []  # module scopes and gradient-ready hooks, while the detailed tier lasts
        self.unhooked: list[tuple[str, Any]] = []  # in the detailed tier: parameters frozen so far, not hooked yet
        self.ready_in_step: list[tuple[str, float]] = []  # (parameter, when its gradient was ready) since the step
        # a bucket's identity (a parameter's name; else its call, bytes and place) -> its index (`_bucket_index`)
        self.bucket_slots: dict[Any, int] = {}
        self.backend = ""
        # optimizer sharding by hand (ZeRO): the gradients reduce-scattered, each rank stepping its shard, the
        # parameters all-gathered after the step; the iteration then ends after those gathers
        self.sharded = False  # a step's gradient calls included a reduce-scatter
        self.scattered_in_step = False
        self.gradient_gathers_in_step = 0  # all-gathers between the backward and the step (compressed gradients)
        self.compressed = False  # some step's gradients were all-gathered (compressed by hand)
        self.gathers_since_step = 0  # parameter gathers since the last step, before any backward
        self.gathers_per_step = 0  # what the last step was followed by before its next backward
        self.pending_gathers = 0  # a leading step returned: its iteration ends after this many more gathers
        self.awaiting: Optional[CommRecord] = None  # a waited call whose Work has no future: ended by its wait
        self.begin_after_wait = False  # the step's last gather was launched: its iteration ends at the wait's return
        self.fsdp = False  # FSDP on the CPU: every gather and reduce-scatter of a step a blocking bucket (module doc)
        self.fsdp_group_sizes: set[int] = set()  # the sizes of FSDP's groups smaller than the job (HSDP's mesh)
        self.horovod = False  # the gradient calls are horovod.torch's (no DistributedOptimizer: runtime/gradient_calls)
        self.handle_works = HandleWorks()  # their async calls' handles, done at hvd.synchronize

    # ---- what DDPTracker also offers the session --------------------------------------------------------
    def describe(self) -> dict:
        return {"ddp": 0, "framework": self.framework, "user_comm_hook": False, "builtin_comm_hook": False,
                "timed_buckets": True, "backend": self.backend or "unknown", "serial": self.serial,
                "asynchronous": self.asynchronous, "sharded": self.sharded, "fsdp": self.fsdp, "blocking": self.fsdp,
                "fsdp_subgroup_sizes": sorted(self.fsdp_group_sizes),
                "calls": ("FSDP's all_gather, reduce_scatter" if self.fsdp else
                          self.call_name("reduce_scatter, all_gather", "reducescatter, allgather") if self.sharded
                          else self.call_name("all_gather", "allgather") if self.compressed
                          else self.call_name("all_reduce", "allreduce"))}

    def call_name(self, torch_name: str, horovod_name: str) -> str:
        return f"horovod.torch.{horovod_name}" if self.horovod else f"torch.distributed.{torch_name}"

    def detail_tier_started(self) -> None:
        """Module scopes for the profiler's op names, and each parameter's gradient-ready time in the backward (what
        a DDP of the model would overlap its buckets with: the re-bucketing what-ifs), as DDPTracker has them."""
        session = self.session
        if session.cfg.kineto and session.cfg.kineto_iters > 0:
            from dprorun.runtime.scopes import add_module_scopes

            for root in self.roots:
                self.scope_handles.extend(session.guard("naming module scopes", add_module_scopes, root) or [])
        if not session.cfg.param_hooks or self.fsdp:  # FSDP's sharded gradients: no re-bucketing to time for
            return
        self.unhooked = list(self.named_parameters())
        self._hook_trainable_params()

    def _hook_trainable_params(self) -> None:
        """Hooks on the parameters that require a gradient now; the others at a later backward of the tier, once
        trainable (a backbone unfrozen in the window had no ready times: torch refuses a hook on a frozen tensor)."""
        session, waiting = self.session, []
        for name, param in self.unhooked:
            if not param.requires_grad:
                waiting.append((name, param))
                continue

            def ready(p, name=name):
                self.ready_in_step.append((name, session.now_us()))

            self.scope_handles.append(param.register_post_accumulate_grad_hook(ready))
        self.unhooked = waiting

    def named_parameters(self):
        """The trained models' parameters, named as their model names them; the k-th model's after the first (a
        GAN's generator beside its critic, each with its optimizer) prefixed "model<k>." (their names repeat)."""
        seen = set()
        for k, root in enumerate(self.roots):
            for name, param in root.named_parameters():
                if id(param) not in seen:
                    seen.add(id(param))
                    yield (f"model{k}.{name}" if k else name), param

    def window_stopped(self) -> None:
        self.stop_param_hooks()

    def stop_param_hooks(self) -> None:
        for handle in self.scope_handles:
            handle.remove()
        self.scope_handles.clear()
        self.unhooked = []

    def wrapper_built(self, what: str) -> None:
        """The script built a wrapper the hooks profile after this tracker joined (a phase trained by hand, then
        DDP): the wrapper's tracker counts the iterations from now on. This one leaves; inside the window or the
        clean iterations the run's profiling ends here, as where the script trains another model."""
        session = self.session
        if not self.joined:
            return
        if session.phase != "warmup":
            session.primary_replaced(session.iteration + 1, what)
        self.joined = self.primary = False
        self.stop_param_hooks()
        session.trackers.remove(self)

    # ---- what the patches tell ----------------------------------------------------------------------------
    def watching(self) -> bool:
        """Is anyone else profiling the job? (a DDP module or a Horovod optimizer: then this tracker stays out)"""
        return self.joined or not self.session.trackers

    def backward_started(self, start_us: float) -> None:
        if self.pending_gathers:  # fewer gathers than the step before: the iteration ends at this backward
            self.session.guard("ending an iteration of a sharded step", self._begin_iteration)
        if self.gathers_since_step:
            self.gathers_per_step, self.gathers_since_step = self.gathers_since_step, 0
        if self.unhooked and self.session.detail_active:
            self.session.guard("hooking gradient-ready times", self._hook_trainable_params)
        self.in_backward = start_us

    def backward_called(self, start_us: float, end_us: float) -> None:
        if self.step_hook is None and not self.joined:  # the steps close the backward passes (`_step_done_hook`)
            self._watch_steps()
        self.backward = (start_us, end_us)
        self.in_backward = None
        self.next_ready_us = end_us
        if self.step_backward is not None and self.step_backward[1] is None:
            self.step_backward = (self.step_backward[0], end_us)

    def _gathers_gradients(self, name: str) -> bool:
        """An all-gather between a backward and its step: compressed gradients (top-k values and indices), not a
        sharded step's parameters (gathered after the step)."""
        return name in PARAMETER_GATHERS and (self.in_backward is not None or self.backward is not None)

    def wants_work(self, name: str, args: tuple, kwargs: dict) -> bool:
        """Is this synchronous call a bucket to record in the window (a gradient call, or a sharded step's parameter
        gather)? Then it is made with async_op=True and waited for at once (runtime/watch.py), as torch's
        synchronous path does: its Work's future tells when it completed, where an NCCL call returns once enqueued
        on its stream."""
        if not (self.joined and self.session.detail_active) or self.fsdp:  # FSDP's calls: timed as they are
            return False
        if name in PARAMETER_GATHERS and not self._gathers_gradients(name):
            return self.pending_gathers > 0 and self.in_backward is None and self.backward is None
        return (name in GRADIENT_COLLECTIVES or self._gathers_gradients(name)) and (
            self.in_backward is not None or self.backward is not None)

    def collective_returned(self, name: str, args: tuple, kwargs: dict, result: Any, us: float,
                            waited: bool = False) -> bool:
        """A torch.distributed call of the script's returned after `us` µs (`waited`: a synchronous call made
        asynchronous to be waited for at once): True where it is one of the step's gradient buckets (recorded here,
        not among the script's other collectives)."""
        if self.fsdp and self.joined:
            return self._fsdp_call_returned(name, args, kwargs, us)
        gathered = self._gathers_gradients(name)
        if name in PARAMETER_GATHERS and not gathered:
            return self._gather_returned(name, args, kwargs, result, us, waited)
        inside = self.in_backward is not None  # a gradient hook's call (the script overlaps them by hand)
        if not (name in GRADIENT_COLLECTIVES or gathered) or not (inside or self.backward is not None) or \
                not self.watching():
            return False
        if self.calls_in_step == 0:
            self.step_backward = (self.in_backward, None) if inside else self.backward
        self.calls_in_step += 1
        self.horovod = self.horovod or name in HOROVOD_KINDS
        self.scattered_in_step = self.scattered_in_step or KINDS[name] == "reduce_scatter"
        self.gradient_gathers_in_step += gathered
        self.compressed = self.compressed or (gathered and self.joined)  # before it: maybe ZeRO's first gathers
        if not self.joined:
            self.bytes_in_step += covered(name, args, kwargs)[1]
            self.session.script_use.gradient_calls_after_backward += 1
            if self.step_hook is None:
                self._watch_steps()
            return False
        session = self.session
        if session.detail_active:
            session.guard("recording a gradient all-reduce", self._record, name, args, kwargs, result, us, inside,
                          waited)
        return True

    def _gather_returned(self, name: str, args: tuple, kwargs: dict, result: Any, us: float, waited: bool) -> bool:
        """A parameter gather after the step, before the next backward: counted (before the window: how many follow
        a step), and, while a sharded step's iteration waits for them, a bucket after its update."""
        if self.backward is not None or self.in_backward is not None or not self.watching():
            return False
        self.gathers_since_step += 1
        if not self.pending_gathers:
            return False
        session = self.session
        index = GATHER_CALL_BASE + self.gathers_per_step - self.pending_gathers
        if session.detail_active:
            session.guard("recording a parameter gather", self._record_gather, name, args, kwargs, result, us, index,
                          waited)
        self.pending_gathers -= 1
        if not self.pending_gathers:
            if waited:  # made asynchronous: the call has only been launched; it ends at its wait (`work_waited`)
                self.begin_after_wait = True
            else:
                self._begin_iteration()
        return True

    def _fsdp_call_returned(self, name: str, args: tuple, kwargs: dict, us: float) -> bool:
        """A call FSDP made (a gather, in the forward or the backward; a reduce-scatter): the step's next bucket."""
        if name not in GRADIENT_COLLECTIVES + PARAMETER_GATHERS:
            return False
        evaluating = self.in_backward is None and not self.forward_trains  # a forward that trains nothing
        if evaluating:
            if self.inference_calls_in_step == 0:
                self.session.records.count_inference_pass(self.session.iteration)
            self.inference_calls_in_step += 1
        else:
            if self.in_backward is not None and self.step_backward is None:  # the step's backward: its first call
                self.step_backward = (self.in_backward, None)
            self.calls_in_step += 1
        if self.session.detail_active:
            self.session.guard("recording an FSDP collective", self._record_fsdp, name, args, kwargs, us, evaluating)
        return True

    def _record_fsdp(self, name: str, args: tuple, kwargs: dict, us: float, evaluating: bool) -> None:
        """An FSDP call's bucket, from its start to its return: it held the thread all along (gloo, no async_op).
        A bucket is the n-th call of its kind and bytes in a step (`fsdp_keys`), not the n-th call: a step whose
        sequence differs (the one after an evaluation, where FSDP gathers one unit more) keeps its other calls'
        buckets, and an evaluation's gathers are buckets of their own (INFERENCE_CALL_BASE on)."""
        session = self.session
        now = session.now_us()
        tensor, nbytes = covered(name, args, kwargs)
        kind = (evaluating, name.split("_")[0], nbytes)
        self.fsdp_kinds_in_step[kind] = self.fsdp_kinds_in_step.get(kind, 0) + 1
        slot = (kind, self.fsdp_kinds_in_step[kind])
        index = self.fsdp_keys.get(slot)
        if index is None:  # the next index of its kind of call (the step's, or an evaluation's)
            index = self.fsdp_keys[slot] = sum(k[0][0] == evaluating for k in self.fsdp_keys) + (
                INFERENCE_CALL_BASE if evaluating else 0)
        key = (0, index)
        if key not in session.records.buckets:
            session.records.buckets[key] = bucket_entry(name, tensor, nbytes, [f"{name}{index}"])
            size = group_size(name, args, kwargs)
            if size and size != session.world_size:  # HSDP: sharded within, replicated across, groups of its mesh
                self.fsdp_group_sizes.add(size)
        self.step_records.append(self._comm_record(index, now - us, now, None, waited=False, inside=True))

    def _record(self, name: str, args: tuple, kwargs: dict, result, us: float, inside: bool, waited: bool) -> None:
        """One bucket's record: from where the call could have started (inside the backward: its own start; after
        it: the backward's end, or the previous synchronous call's return) to its return (or its Work's end)."""
        session = self.session
        now = session.now_us()
        if self.calls_in_step == 1:
            self.names.read()
        tensor, nbytes = covered(name, args, kwargs)
        index = self._bucket_index(name, tensor, nbytes)
        key = (0, index)
        if key not in session.records.buckets:
            gathered = name in PARAMETER_GATHERS  # compressed gradients: no parameter's gradient as it is
            inside_backward = self.in_backward is not None
            names = (None if gathered else self.names.names_of(name, args, kwargs, tensor, nbytes,
                                                               inside_backward)) or [f"{name}{index}"]
            session.records.buckets[key] = bucket_entry(name, tensor, nbytes, names)
            self.step_new_keys.append(key)
            if gathered:  # no parameter of the model's: left out of its parameters' table
                session.records.buckets[key]["gathers_gradients"] = True
            else:
                self._add_params(names, nbytes)
        work = self.handle_works.work(name, result)
        if inside:
            start = now - us
        else:
            start = max(self.next_ready_us, now - us) if work is not None and not waited else self.next_ready_us
        for name in session.records.buckets[key]["params"]:
            if name not in self.names.param_bytes or not session.cfg.param_hooks:  # no hook times it: at the call
                self.step_ready.append((session.iteration, name, start))
                session.records.grad_ready.append(self.step_ready[-1])
        self.step_records.append(self._comm_record(index, start, now, work, waited, inside))

    def _add_params(self, names: list[str], nbytes: int) -> None:
        """A new bucket's parameters in the layout's table (order, bytes): a call named after itself, its bytes."""
        params = self.session.records.params.setdefault(0, {"order": [], "bytes": {}, "bucket_cap_mb": 0.0})
        sizes = self.names.param_bytes if names[0] in self.names.param_bytes else {names[0]: nbytes}
        for param in names:
            if param not in params["bytes"]:
                params["order"].append(param)
                params["bytes"][param] = sizes[param]

    def _bucket_index(self, name: str, tensor, nbytes: int) -> int:
        """A call's bucket: the parameter whose gradient it is (its bucket whatever calls came before it: a backbone
        unfrozen mid-run, or a gradient skipped where it is None, moved the head's calls, and its buckets took the
        backbone's names); any other call (a flat buffer) by its kind, bytes and place in the step."""
        param = self.names.grad_names.get(tensor.data_ptr()) if tensor is not None else None
        if param is None and tensor is not None and self.in_backward is not None:
            self.names.read()
            param = self.names.grad_names.get(tensor.data_ptr())
        slot = param if param is not None and self.names.param_bytes.get(param) == nbytes else \
            (name, nbytes, self.calls_in_step - 1)
        return self.bucket_slots.setdefault(slot, len(self.bucket_slots))

    def _record_gather(self, name: str, args: tuple, kwargs: dict, result, us: float, index: int,
                       waited: bool) -> None:
        """A parameter gather's bucket (its parameters are no gradients: named after the call), from the step's end
        or the previous gather's return."""
        session = self.session
        now = session.now_us()
        key = (0, index)
        if key not in session.records.buckets:
            tensor, nbytes = covered(name, args, kwargs)
            session.records.buckets[key] = bucket_entry(name, tensor, nbytes, [f"{name}{index - GATHER_CALL_BASE}"])
        work = self.handle_works.work(name, result)
        start = max(self.next_ready_us, now - us) if work is not None and not waited else self.next_ready_us
        self._comm_record(index, start, now, work, waited, inside=False)

    def _comm_record(self, index: int, start: float, now: float, work, waited: bool, inside: bool) -> CommRecord:
        """The call's comm record, ended by its Work's future where it returned one."""
        session = self.session
        record = CommRecord(session.iteration, 0, index, start, start, now)
        session.records.comm.append(record)
        if work is None or waited:
            self.serial = True
            if not inside:
                self.next_ready_us = now  # made asynchronous and waited for: moved to the wait's end (`work_waited`)
        else:
            self.asynchronous = True
        if work is not None and waited and self.backend == "gloo":
            # waited for at once on the CPU: it ends at the wait's return, with no Python callback run on gloo's
            # threads (such callbacks go with a rare heap corruption in a rank: RESULTS.md, session 46)
            self.awaiting = record
        elif work is not None:
            def done(_future, record=record):
                record.done_us = session.now_us()

            try:
                work.get_future().add_done_callback(done)
            except RuntimeError:  # no future (gloo's reduce_scatter): a waited call ends at its wait's return
                self.awaiting = record if waited else None
        return record

    def work_waited(self) -> None:
        """A synchronous call made asynchronous returned from its wait: the next call could start only now (and a
        call whose Work has no future ended now)."""
        now = self.session.now_us()
        if self.awaiting is not None:
            self.awaiting.done_us, self.awaiting = now, None
        if self.in_backward is None:
            self.next_ready_us = now
        if self.begin_after_wait:
            self.session.guard("ending an iteration of a sharded step", self._begin_iteration)

    def _leave_out_step(self) -> None:
        """A step that ends no iteration (the other model's, of two stepped in turn: a GAN's by hand): its
        all-reduces ran before the iteration's backward0, inside forward0 as measured. They stay among the script's
        own collectives (timed, named in what-ifs), not buckets: as buckets they were replayed once more, after the
        backward (a GAN's replay 34 % over its window)."""
        records = self.session.records
        dropped = {id(record) for record in self.step_records} | {id(row) for row in self.step_ready}
        records.comm[:] = [record for record in records.comm if id(record) not in dropped]
        records.grad_ready[:] = [row for row in records.grad_ready if id(row) not in dropped]
        for record in self.step_records:
            records.add_script_collective(record.iteration, self.call_name("all_reduce", "allreduce"),
                                          max(0.0, (record.done_us or record.enqueue_us) - record.enqueue_us))
        params = records.params.get(0, {"order": [], "bytes": {}})
        for key in self.step_new_keys:
            for name in records.buckets.pop(key, {}).get("params", []):
                params["bytes"].pop(name, None)
                if name in params["order"]:
                    params["order"].remove(name)
        self.ready_in_step.clear()

    def _keep_ready_times(self) -> None:
        """At the step: its gradients' ready times in its last backward (an accumulated micro-batch's, earlier, are
        left out)."""
        session = self.session
        if self.step_backward is not None and session.detail_active:
            start = self.step_backward[0]
            session.records.grad_ready.extend((session.iteration, name, t) for name, t in self.ready_in_step
                                              if t >= start)
        self.ready_in_step.clear()

    def _watch_steps(self) -> None:
        """torch's global post-hook of every optimizer step, from the first backward (registered here, not inside an
        optimizer hook: torch iterates over them)."""
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self.step_hook = register_optimizer_step_post_hook(self._step_done_hook)

    def _step_done_hook(self, optimizer, args, kwargs) -> None:
        """torch's global post-hook of every optimizer step: the optimizer's step gets wrapped, on its class and on
        the instance where something wrapped it there (nothing else here: the session's own hooks are added or
        removed at the window's edges, and torch is iterating over them now). Before the tracker joins, a step
        with no call since the backward closes that backward: calls after the step (parameters averaged every few
        steps: local SGD) share no gradients (they were taken for the next step's, and the job joined on them)."""
        if not self.joined and not self.calls_in_step:
            self.backward = None
            return
        self.session.script_use.steps_after_gradient_calls += 1
        if not self.joined and not (self.calls_in_step and not self.session.trackers):
            return
        cls = type(optimizer)
        if not getattr(cls.step, "_dpro_step_returned", False):
            self.session.guard("wrapping the optimizer's step", self._wrap_class_step, cls)
        own = optimizer.__dict__.get("step")
        if own is not None and not getattr(own, "_dpro_step_returned", False):
            self.session.guard("wrapping the optimizer's step", self._wrap_instance_step, optimizer, own)

    def _stepped(self, optimizer, call, *args, **kwargs):
        """call(...) (an optimizer's step), `step_returned` after the outermost of the wrappers it runs through (a
        subclass's step calling super().step(), an LR scheduler's wrapper calling the class's)."""
        key = id(optimizer)
        self.stepping[key] = self.stepping.get(key, 0) + 1
        try:
            result = call(*args, **kwargs)
        finally:
            self.stepping[key] -= 1
        if self.stepping[key] == 0:
            self.session.guard("closing a step of the script's own all-reduces", self.step_returned, optimizer)
        return result

    def _wrap_class_step(self, cls) -> None:
        """cls.step returns through `step_returned` (its first step, this one, returns unseen): wrapped on the
        class, as torch wraps it for its hooks (the class stays picklable; an LR scheduler made later wraps the
        instance's bound step, which calls through it)."""
        original = cls.step

        @functools.wraps(original)
        def step(optimizer, *args, **kwargs):
            return self._stepped(optimizer, original, optimizer, *args, **kwargs)

        step.hooked = True  # torch's own mark: its hooks' wrapper is inside, not to be added again
        step._dpro_step_returned = True
        cls.step = step

    def _wrap_instance_step(self, optimizer, own) -> None:
        """An LR scheduler made before the first step wraps the instance's step around the class's function of
        then (torch's `patch_track_step_called`), so the class's wrapper is never reached through it: the
        instance's wrapper is wrapped too (its marks kept: a later scheduler sees the step wrapped already)."""
        @functools.wraps(own)
        def step(*args, **kwargs):
            return self._stepped(optimizer, own, *args, **kwargs)

        step._dpro_step_returned = True
        optimizer.step = step

    def step_returned(self, optimizer) -> None:
        """An optimizer's step returned. Not yet in the job: it joins where the step followed gradient all-reduces
        and nothing else profiles the job. In the job: a leading step ends the iteration."""
        session = self.session
        leading = self.steps.step(id(optimizer))
        calls, sent = self.calls_in_step, self.bytes_in_step
        self.calls_in_step, self.bytes_in_step, self.backward, self.in_backward = 0, 0, None, None
        self.inference_calls_in_step = 0
        self.fsdp_kinds_in_step = {}
        self.sharded = self.sharded or self.scattered_in_step
        self.scattered_in_step, self.gathers_since_step = False, 0
        compressed, self.gradient_gathers_in_step = self.gradient_gathers_in_step, 0
        if self.joined and not leading:
            self._leave_out_step()
        else:
            self._keep_ready_times()
        self.step_records, self.step_ready, self.step_new_keys = [], [], []
        self.names.reset()
        if not self.joined:
            share = GATHERED_SHARE if compressed else SHARED_SHARE
            shared = calls > 0 and sent >= share * gradient_bytes(optimizer)
            # FSDP's wrappers reduce-scatter in the backward and gather in the forward and the backward, through the
            # same calls (torch 2.13's reduce_scatter_single, all_gather_single): no ZeRO by hand, but blocking
            # buckets where they block (the CPU)
            fsdp = session.script_use.fsdp_wrappers > 0
            if fsdp and not fsdp_blocks():
                return  # on a GPU FSDP overlaps its calls on its own streams: not modelled
            if shared and not session.trackers and session.phase == "warmup" and not session.disabled:
                self._join(optimizer, fsdp)
            return
        if id(optimizer) not in self.optimizers_seen:
            self._add_trained_model(optimizer)
        if not leading:
            return
        if session.detail_active and self.step_backward is not None:
            start, end = self.step_backward
            session.mark("forward0", self.iteration_start, start)
            session.mark("backward0", start, end)
        self.step_backward = None
        if self.sharded and self.gathers_per_step and not self.fsdp:  # the iteration ends once its parameters gathered
            self.pending_gathers = self.gathers_per_step
            self.next_ready_us = session.now_us()
            return
        self._begin_iteration()

    def _begin_iteration(self) -> None:
        self.pending_gathers, self.begin_after_wait = 0, False
        self.session.begin_iteration()
        self.iteration_start = self.session.now_us()

    def _add_trained_model(self, optimizer) -> None:
        """The outermost modules holding the optimizer's parameters (its gradients' names, module scopes), once per
        optimizer."""
        from dprorun.runtime.horovod import trained_roots

        self.optimizers_seen.add(id(optimizer))
        held = {id(root) for root in self.roots}
        found = self.session.guard("finding the trained model", trained_roots, optimizer) or []
        self.roots += [root for root in found if id(root) not in held]

    def _join(self, optimizer, fsdp: bool = False) -> None:
        from dprorun.runtime.backends import group_backend

        session = self.session
        self.joined = self.primary = True
        if fsdp:  # FSDP's calls, gathers included, are the step's buckets (module doc): no ZeRO-by-hand counting
            self.fsdp = self.sharded = True
            session.guard("watching FSDP's forwards", _watch_fsdp_grad_mode, self)
            self.gathers_per_step = self.gathers_since_step = self.pending_gathers = 0
        session.trackers.append(self)
        self.backend = "horovod" if self.horovod else group_backend()
        if self.backend == "unknown":
            self.backend = ""
        self._add_trained_model(optimizer)
        self.steps.new_lead()
        self.steps.step(id(optimizer))
        self.step_backward = None
        session.begin_iteration()
        self.iteration_start = session.now_us()


def _watch_fsdp_grad_mode(tracker: ScriptCollectivesTracker) -> None:
    """Tell the tracker, at each FSDP2 forward's start, whether autograd records it: FSDP gathers under no_grad
    whatever the script does, so the grad mode at the call says nothing; a forward that trains nothing (an evaluation
    under no_grad) is read where it enters (`FSDPState._root_pre_forward`, run at each unit's first entry of a
    forward, looked up on the class at each call)."""
    import torch

    try:
        from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
    except ImportError:  # another torch: every forward taken as training, as before
        return
    original = FSDPState._root_pre_forward
    if getattr(original, "_dpro_grad_mode", False):
        return

    @functools.wraps(original)
    def root_pre_forward(self, *args, **kwargs):
        tracker.forward_trains = torch.is_grad_enabled()
        return original(self, *args, **kwargs)

    root_pre_forward._dpro_grad_mode = True
    FSDPState._root_pre_forward = root_pre_forward


def watch_gradient_collectives(session: RankSession) -> None:
    """The tracker, told of every backward call (torch.autograd.backward, what Tensor.backward calls) and of the
    script's torch.distributed calls as they return (runtime/watch.py: ScriptUse.returned)."""
    import time

    autograd = sys.modules["torch.autograd"]
    if getattr(autograd.backward, "_dpro_timed", False):
        return
    tracker = ScriptCollectivesTracker(session)
    session.script_use.returned = tracker.collective_returned
    session.script_use.wants_work = tracker.wants_work
    session.script_use.work_waited = tracker.work_waited
    session.script_use.synchronized = tracker.handle_works.synchronized
    original = autograd.backward
    compiler = sys.modules.get("torch.compiler")

    @functools.wraps(original)
    def backward(*args, **kwargs):
        if not tracker.watching() or (compiler is not None and compiler.is_compiling()):
            return original(*args, **kwargs)
        started = time.perf_counter()
        tracker.backward_started(session.now_us())
        result = original(*args, **kwargs)
        took_us = (time.perf_counter() - started) * 1e6
        end = session.now_us()
        tracker.backward_called(end - took_us, end)
        return result

    backward._dpro_timed = True
    autograd.backward = backward
