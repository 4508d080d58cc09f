"""Zero-code-change instrumentation of torch.nn.parallel.DistributedDataParallel.

Patched into the class when torch.nn.parallel.distributed is imported:
  - __init__: attaches a DDPTracker to every DDP module the script (or Lightning / HF Trainer) builds;
  - register_comm_hook: wraps a user's comm hook with bucket timing instead of replacing it (registered after
    the tracker's own went in, the script's takes over inside it: DDP takes one registration).
Without a user hook the tracker registers its own all-reduce hook (DDP's default semantics) wrapped with timing
at the first forward of the profiling window (DDP's built-in path runs until then). During the profiling window
the tracker records per bucket: enqueue time (the hook is called when the bucket is ready), and completion (the
future's callback); the gloo/NCCL transmission span itself comes from the profiler's trace, so queueing and
transmission are separated by the reader.
"""
from __future__ import annotations

import functools
import weakref
from typing import Any, Callable, Optional

from dprorun.layout import CommRecord, sparse_bucket_fields
from dprorun.runtime.apply import resolve_group
from dprorun.runtime.copies import HOOK_MARK, USER_HOOK, own_hook
from dprorun.runtime.log import as_the_callers
from dprorun.runtime.outputs import tensors_requiring_grad
from dprorun.runtime.scopes import outside_compiled
from dprorun.runtime.session import RankSession

# torch's own compressing comm hooks (ddp_comm_hooks.default_hooks): what they send, per element
COMPRESSING_HOOKS = {"fp16_compress_hook": ("float16", 2), "bf16_compress_hook": ("bfloat16", 2)}

TRAINS_IN_EVAL_MODE = ("note: the script trains its DDP model in eval mode (model.eval, dropout off, BatchNorm's "
                       "statistics fixed); its forwards with gradients on are read as training forwards, those under "
                       "no_grad as evaluations")
MAX_SYNCED_FORWARDS_A_STEP = 64  # beyond these without an optimizer step, a synchronised forward begins an iteration
STEADY_MEMORY_ITERATIONS = 3  # forward starts (after the first optimizer step) read for the steady memory


class DDPTracker:
    """One DDP module's hooks and records. Index 0 is the primary module, whose training forwards count the
    iterations; a module built after the primary's last training step and then trained takes that role over
    (`_take_over`). The tracker holds its module weakly: a script that trains one model after another (folds,
    pre-training then fine-tuning) frees each as it would under torchrun."""

    def __init__(self, session: RankSession, ddp, index: int):
        self.session = session
        self._ddp = weakref.ref(ddp)
        self.index = index
        self.primary = index == 0
        # the primary's training forwards when this module was built (0: the primary had not trained yet)
        self.primary_forwards_at_init = session.primary_forwards
        self.user_hook = False
        self.user_hook_name = None  # the script's own comm hook (its function's name)
        self.builtin_hook = False
        self.hook_registered = False
        self.hook_decided = False
        # (hook, state) the comm hook dprorun registered with DDP runs: its own, or the script's registered later
        self.active_comm_hook: Optional[tuple[Callable, Any]] = None
        self.buckets_reduced = 0  # buckets through dprorun's comm hook (or the script's, timed): trained or not
        # a forward in eval mode with gradients on: (the job's optimizer steps, buckets_reduced) then, to tell at
        # the next forward whether it trained; once one did, the script trains in eval mode (`trains_in_eval_mode`)
        self.eval_forward_with_grad: Optional[tuple[int, int]] = None
        self.trains_in_eval_mode = False
        self.prev_forward_synced = True
        # the job's optimizer steps when this module's latest iteration began (RankSession.optimizer_steps), and the
        # synchronised training forwards since then
        self.steps_at_iteration = -1
        self.synced_forwards = 0
        self.first_iteration = 0  # the first iteration counted on this module
        self.backend = _backend_name(ddp)  # now: at the job's end its process group may be gone ("unknown")
        self.group_ranks = _group_ranks(ddp)  # the global ranks DDP synchronises with (a subgroup: fewer)
        # what DDP broadcasts from its first rank before every training forward (broadcast_buffers: BatchNorm's
        # running statistics, a quantizer's observers): a collective in the forward, outside the buckets; the classes
        # of the modules that hold them, to name them
        broadcast = getattr(ddp, "broadcast_buffers", False)
        self.broadcast_buffer_bytes = (sum(b.numel() * b.element_size() for b in ddp.module.buffers())
                                       if broadcast else 0)
        self.broadcast_buffer_owners = sorted({type(m).__name__ for m in ddp.module.modules() if broadcast
                                               and next(m.buffers(recurse=False), None) is not None})
        self.param_names: dict[int, str] = {}
        order, nbytes = [], {}
        for name, param in ddp.module.named_parameters():
            if param.requires_grad:
                self.param_names[id(param)] = name
                order.append(name)
                nbytes[name] = param.numel() * param.element_size()
        session.records.params[index] = {"order": order, "bytes": nbytes,
                                 "bucket_cap_mb": getattr(ddp, "bucket_bytes_cap", 0) / (1 << 20)}
        self.param_handles: list = []
        self.unhooked_params: Optional[list] = None  # in the window: (parameter, name) not hooked yet
        self.activation_meter = None
        self.last_inputs = None
        self.activations_measured = False
        self.memory_at_init: dict[str, int] = {}
        session.guard("reading memory at DDP construction", self._memory_at_init)
        self.update_meter = None
        if self.primary:
            session.guard("reading memory around the optimizer step", self._start_update_meter)
        self.ring = None
        if session.cfg.comm_detail == "ring":
            session.guard("setting up the ring comm detail", self._setup_ring)
        session.guard("counting optimizer steps", session.count_optimizer_steps)
        self._replicated = None  # replicate()'s module (weakly), where the script calls that and not DDP
        ddp.register_forward_pre_hook(own_hook(outside_compiled(self._pre_forward)), with_kwargs=True)
        ddp.register_forward_hook(own_hook(outside_compiled(self._post_forward)))

    @property
    def ddp(self) -> Optional[Any]:
        """The DistributedDataParallel module, None once the script dropped it."""
        return self._ddp()

    @property
    def model(self) -> Optional[Any]:
        """The module the script trains: DDP's wrapped module, or the module `replicate()` gave a DDP; None once
        the script dropped it."""
        if self._replicated is not None:
            return self._replicated()
        ddp = self.ddp
        return None if ddp is None else ddp.module

    def attach_to_replicated(self, module, names: list[str]) -> None:
        """torch.distributed._composable.replicate(module): DDP is built over a ParameterList of the module's
        parameters (named "0", "1", ...) and never called; the module's own forward hooks run DDP's forward steps.
        The iterations are counted on that module's forwards (our hooks after replicate()'s), its parameters named
        as the module names them (replicate's list, in the ParameterList's order)."""
        self._replicated = weakref.ref(module)
        renamed = dict(zip([str(k) for k in range(len(names))], names))
        self.param_names = {pid: renamed.get(name, name) for pid, name in self.param_names.items()}
        record = self.session.records.params[self.index]
        record["order"] = [renamed.get(name, name) for name in record["order"]]
        record["bytes"] = {renamed.get(name, name): nbytes for name, nbytes in record["bytes"].items()}
        module.register_forward_pre_hook(own_hook(outside_compiled(self._pre_forward)), with_kwargs=True)
        module.register_forward_hook(own_hook(outside_compiled(self._post_forward)))

    def _memory_at_init(self) -> None:
        import torch

        from dprorun.runtime.rank_files import current_rss_bytes

        self.memory_at_init["rss_at_ddp_init_bytes"] = current_rss_bytes()
        if torch.cuda.is_available():
            self.memory_at_init["cuda_allocated_at_ddp_init_bytes"] = int(torch.cuda.memory_allocated())
        memory = self.session.records.memory
        for key, value in self.memory_at_init.items():
            memory.setdefault(key, value)

    def _start_update_meter(self) -> None:
        """The optimizer step's temporaries over the first steps of the model whose iterations count
        (runtime/update_memory.py), in the warm-up iterations only."""
        from dprorun.runtime.update_memory import TRANSIENT_KEYS, UpdateMemoryMeter

        if self.update_meter is not None:
            self.update_meter.stop()
        for key in TRANSIENT_KEYS:
            self.session.records.memory.pop(key, None)
        session = self.session
        self.update_meter = UpdateMemoryMeter(session.records.memory, STEADY_MEMORY_ITERATIONS + 1,
                                              lambda: session.phase == "warmup" and self.primary, session.guard)
        self.update_meter.start()

    def _memory_at_forward_start(self, module) -> None:
        """Steady memory between iterations: everything allocated when a forward starts (parameters, optimizer
        state, library workspaces such as cuBLAS's, the input batch) minus the gradients that happen to exist
        then (zero_grad(set_to_none) frees them, zero_grad() keeps them); the largest over the first iterations
        after the first optimizer step. Peak = steady + gradients + activations (dprorun.memory)."""
        import torch

        from dprorun.runtime.rank_files import current_rss_bytes

        grads = {"cpu": 0, "cuda": 0}
        for param in module.parameters():
            if param.grad is not None:
                grads["cuda" if param.grad.is_cuda else "cpu"] += param.grad.numel() * param.grad.element_size()
        memory = self.session.records.memory
        rss = current_rss_bytes() - grads["cpu"]
        memory["rss_steady_bytes"] = max(memory.get("rss_steady_bytes", 0), int(rss))
        if torch.cuda.is_available():
            steady = int(torch.cuda.memory_allocated()) - grads["cuda"]
            memory["cuda_steady_bytes"] = max(memory.get("cuda_steady_bytes", 0), steady)

    def _take_over(self) -> None:
        """The script trains this module, built after the primary's last training step (the next fold, fine-tuning
        after pre-training, the real model after a learning-rate finder's): iterations are counted on it now. Before
        the window it becomes DDP 0, what the analysis reads as the job's model (its memory read afresh); inside the
        window or the clean iterations the run ends its profiling there (`RankSession.primary_replaced`)."""
        session = self.session
        old = next(t for t in session.trackers if getattr(t, "primary", False))
        old.primary, self.primary = False, True
        self.first_iteration = session.iteration + 1
        session.optimizer_steps.new_lead()  # this model's optimizer, not the previous one's, marks the iterations
        if session.phase != "warmup":
            session.primary_replaced(session.iteration + 1, "DDP model")
            return
        records = session.records
        records.params[old.index], records.params[self.index] = records.params[self.index], records.params[old.index]
        old.index, self.index = self.index, old.index
        for tracker in (old, self):
            if tracker.ring is not None:
                tracker.ring.ddp_index = tracker.index
        for key in ("rss_steady_bytes", "cuda_steady_bytes"):
            records.memory.pop(key, None)
        records.memory.update(self.memory_at_init)
        if old.update_meter is not None:
            old.update_meter.stop()
        session.guard("reading memory around the optimizer step", self._start_update_meter)

    def describe(self) -> dict:
        return {"ddp": self.index, "user_comm_hook": self.user_hook, "builtin_comm_hook": self.builtin_hook,
                "timed_buckets": self.hook_registered or self.user_hook,
                "backend": self.backend, "user_comm_hook_name": self.user_hook_name, "group_ranks": self.group_ranks,
                "broadcast_buffer_bytes": self.broadcast_buffer_bytes,
                "broadcast_buffer_owners": self.broadcast_buffer_owners}

    # ---- forward / backward ------------------------------------------------------------------------------
    def _pre_forward(self, module, inputs, kwargs=None):
        session = self.session
        import torch

        # DDP's mode or the wrapped model's: Lightning's validation puts the DDP wrapper in eval mode and then
        # restores the modes of its own module only (every later forward was read as eval: no iteration after it);
        # a script may train with its model in eval mode (frozen BatchNorm) under a wrapper in train mode
        train_mode = module.training or getattr(module, "module", module).training
        if self.primary and self.eval_forward_with_grad is not None:
            self._did_the_eval_forward_train()
        training = torch.is_grad_enabled() and (train_mode or self.trains_in_eval_mode)
        if self.primary and not training and torch.is_grad_enabled():
            self.eval_forward_with_grad = (session.optimizer_steps.total, self.buckets_reduced)
        if training and not self.primary and 0 < self.primary_forwards_at_init == session.primary_forwards:
            session.guard("counting iterations on the DDP model the script trains now", self._take_over)
        if training and self.primary and self._starts_iteration():
            session.begin_iteration()
            self.steps_at_iteration, self.synced_forwards = session.optimizer_steps.leading_steps, 0
        if not self.hook_decided and not self.user_hook and not self.builtin_hook and self._hook_due():
            session.guard("registering the DDP comm hook", self._register_default_hook)
        if self.update_meter is not None and self.update_meter.done:
            self.update_meter.stop()  # here, not inside the step: torch iterates over the step hooks then
            self.update_meter = None
        if self.activation_meter is not None:  # the metered forward raised (a script skipping a bad batch): its hooks
            meter, self.activation_meter = self.activation_meter, None  # come off autograd's stack before this one
            session.guard("measuring activations", meter.stop)
        if not training:
            if self.primary:  # an evaluation through the trained model (a validation pass): its iteration is no
                # training iteration as the others are (trace/rundir.inference_set_aside)
                session.records.count_inference_pass(session.iteration)
            return None
        if self.primary:
            session.primary_forwards += 1
            # DDP's flag (no_sync clears it; replicate() sets it on its DDP before our hook runs)
            ddp = self.ddp
            self.prev_forward_synced = bool(getattr(module if ddp is None else ddp, "require_backward_grad_sync", True))
            self.synced_forwards += self.prev_forward_synced
            if 1 <= session.iteration - self.first_iteration <= STEADY_MEMORY_ITERATIONS and session.phase == "warmup":
                session.guard("reading memory at forward start", self._memory_at_forward_start, module)
        if session.detail_active:
            if self.unhooked_params:
                session.guard("hooking gradient-ready times", self._hook_trainable_params)
            if self.primary and session.cfg.measure_variants and session.rank == 0:
                # the batch the compute variants are timed on, keywords included (a model called as
                # model(input_ids=..., labels=...), Hugging Face's way, was timed with none: TypeError)
                self.last_inputs = (tuple(inputs), dict(kwargs or {}))
            session.open_mark(f"forward{self.index}")
            if self.primary and not self.activations_measured:
                from dprorun.runtime.activations import SavedTensorMeter

                self.activation_meter = SavedTensorMeter.for_module(module)
                session.guard("measuring activations", self.activation_meter.start)
        return None

    def _did_the_eval_forward_train(self) -> None:
        """The previous forward ran in eval mode with gradients on, and was counted as an evaluation: where an
        optimizer stepped or DDP all-reduced buckets since, it trained (a script that fine-tunes with dropout off and
        BatchNorm's statistics fixed by calling model.eval: every forward was read as an evaluation, and nothing was
        profiled). From then on a forward with gradients on trains whatever its mode; evaluations under no_grad stay
        evaluations."""
        steps, buckets = self.eval_forward_with_grad
        self.eval_forward_with_grad = None
        if self.session.optimizer_steps.total != steps or self.buckets_reduced != buckets:
            self.trains_in_eval_mode = True
            self.session.records.warnings.append(TRAINS_IN_EVAL_MODE)

    def _starts_iteration(self) -> bool:
        """Does this training forward of the primary module start an iteration? Once the job has stepped an
        optimizer: where its leading optimizer (runtime/steps.py: a GAN's critic, not its generator stepped every
        5th step) stepped since the current iteration began (a module called twice a step, SimCLR's two views, or
        micro-batches accumulated without no_sync: one iteration a step; the iterations were half steps, or
        micro-batches). Before any step, in a script updating by hand, or after MAX_SYNCED_FORWARDS_A_STEP
        synchronised forwards without a step (a script that stepped an optimizer once, a learning-rate finder's, and
        updates by hand since): where the previous forward synchronised its gradients (no_sync's micro-batches
        belong to the synchronised one's iteration)."""
        steps = self.session.optimizer_steps.leading_steps
        if steps and self.synced_forwards < MAX_SYNCED_FORWARDS_A_STEP:
            return steps != self.steps_at_iteration
        return self.prev_forward_synced

    def _post_forward(self, module, inputs, output):
        session = self.session
        if not session.detail_active:
            return None
        now = session.now_us()
        session._close_mark(f"forward{self.index}", now)
        if self.activation_meter is not None:
            meter, self.activation_meter = self.activation_meter, None
            self.activations_measured = True
            saved = session.guard("measuring activations", meter.stop)
            if saved is not None:
                session.records.memory["activation_bytes"] = saved
        found: list = []
        tensors_requiring_grad(output, found)
        if found:
            session.guard("hooking the backward pass", self._hook_backward, found)
        return None

    def _hook_backward(self, outputs: list) -> None:
        import torch

        session = self.session
        fired = [False]
        iteration = session.iteration

        def on_output_grad(grad):
            if fired[0]:
                return None
            fired[0] = True
            start = session.now_us()

            def on_backward_done():
                if session.detail_active:
                    session.mark(f"backward{self.index}", start, session.now_us(), iteration)

            torch.autograd.Variable._execution_engine.queue_callback(on_backward_done)
            return None

        for tensor in outputs:
            tensor.register_hook(on_output_grad)

    # ---- window ------------------------------------------------------------------------------------------
    def detail_tier_started(self) -> None:
        session, model = self.session, self.model
        if model is None:
            return  # a module the script no longer holds
        if session.cfg.kineto and session.cfg.kineto_iters > 0:
            from dprorun.runtime.scopes import add_module_scopes

            self.param_handles.extend(session.guard("naming module scopes", add_module_scopes, model) or [])
        self._hook_trainable_params()

    def _hook_trainable_params(self) -> None:
        """Each DDP parameter's gradient-ready time, hooked where it requires a gradient now: the rest at a later
        forward in the window, once trainable (an encoder and a decoder trained on alternate steps: torch refuses a
        hook on a tensor that requires none, and the window was lost)."""
        session, model = self.session, self.model
        if model is None or not session.cfg.param_hooks:
            return
        if self.unhooked_params is None:
            names = self.param_names
            self.unhooked_params = [(p, names[id(p)]) for p in model.parameters() if id(p) in names]
        waiting = []
        for param, name in self.unhooked_params:
            if not param.requires_grad:
                waiting.append((param, name))
                continue

            def ready(p, name=name):
                session.records.grad_ready.append((session.iteration, name, session.now_us()))

            self.param_handles.append(param.register_post_accumulate_grad_hook(ready))
        self.unhooked_params = waiting

    def window_stopped(self) -> None:
        self.stop_param_hooks()
        meter = self.session.hook_bytes
        if self.user_hook and meter is not None and not meter.finished:
            hooked = {t.index: t.user_hook_name for t in self.session.trackers if getattr(t, "user_hook", False)}
            meter.finish(self.session.records.buckets, hooked)

    def stop_param_hooks(self) -> None:
        for handle in self.param_handles:
            handle.remove()
        self.param_handles.clear()
        self.unhooked_params = None

    # ---- communication -----------------------------------------------------------------------------------
    def _setup_ring(self) -> None:
        import torch.distributed as dist

        from dprorun.runtime.ring import RingAllreduce

        if dist.get_world_size() > 1:
            self.ring = RingAllreduce(self.session, self.index)

    def _hook_due(self) -> bool:
        """Our comm hook goes in when the profiling window starts (or at the first forward when the strategy
        partitions buckets, which needs it): until then DDP keeps its built-in all-reduce, which fuses the
        averaging into its copy into the bucket. A Python hook cannot be taken out again, so the iterations after
        the window keep it (`--no-comm-hook` avoids it altogether)."""
        strategy = self.session.strategy
        return self.session.phase == "active" or (strategy is not None and bool(strategy.partitions))

    def _register_default_hook(self) -> None:
        self.hook_decided = True
        session, ring = self.session, self.ring
        partitioned = session.strategy is not None and bool(session.strategy.partitions)
        if not session.cfg.comm_hook and not partitioned:
            return  # DDP's built-in all-reduce; buckets only through the profiler's collective spans
        self.hook_registered = True
        if partitioned:
            from dprorun.runtime.apply import partitioned_allreduce, pieces_for

            strategy = session.strategy
            session.strategy_applied["partitions"] = dict(strategy.partitions)

            def strategy_allreduce(state, bucket):
                pieces = pieces_for(strategy, bucket.index())
                if pieces > 1:
                    return partitioned_allreduce(state, bucket, pieces)
                return _allreduce_mean(state, bucket)

            self._register_swappable(self.timed(strategy_allreduce))
            return

        if ring is not None:
            def ring_in_window(state, bucket):
                if session.detail_active:
                    return ring.submit(bucket, session.iteration, session.now_us())
                return allreduce_mean(state, bucket)

            hook = ring_in_window
        else:
            hook = allreduce_mean
        self._register_swappable(self.timed(hook))

    def _register_swappable(self, hook: Callable) -> None:
        """Register with DDP a comm hook that runs `hook` (with the module's process group), or, once the script
        registers a comm hook of its own later (`take_over_comm_hook`), the script's: DDP takes one registration,
        and the script's, after dprorun's had gone in with the window, raised "can only be called once"."""
        self.active_comm_hook = (hook, self.ddp.process_group)

        def dpro_comm_hook(state, bucket):
            active, active_state = self.active_comm_hook
            return active(active_state, bucket)

        _ORIGINAL["register_comm_hook"](self.ddp, self.ddp.process_group, own_hook(dpro_comm_hook))

    def take_over_comm_hook(self, state, hook: Callable, name: str = "") -> None:
        """The script registers its comm hook after dprorun's went in: DDP's checks of it, then it runs (timed) from
        the next bucket on; a copy of the module gets it (copies.py); the window's iterations before it ran
        dprorun's all-reduce: said."""
        ddp, session = self.ddp, self.session
        ddp._check_comm_hook(hook)
        self.user_hook, self.user_hook_name = True, name or getattr(hook, "__name__", type(hook).__name__)
        self.active_comm_hook = (self.timed(hook, user=True), state)
        registered = [entry for entry in ddp._comm_hooks if getattr(entry[0], HOOK_MARK, False)]
        for entry in registered:
            setattr(entry[0], USER_HOOK, hook)
        ddp._comm_hooks[:] = [(h, state) if (h, s) in registered else (h, s) for h, s in ddp._comm_hooks]
        if getattr(ddp, "logger", None) is not None:
            ddp.logger._set_comm_hook_name(getattr(hook, "__qualname__", self.user_hook_name))
        where = {"warmup": "before the window",
                 "active": "inside the profiling window (its iterations before it ran dprorun's all-reduce)",
                 "clean": "in the clean iterations after the window (the window ran dprorun's all-reduce)"}.get(
            session.phase, "after the window and its clean iterations")
        session.records.warnings.append(f"the script registered its comm hook ({self.user_hook_name}) at iteration "
                                        f"{session.iteration}, {where}, after dprorun's had gone in: it runs from "
                                        f"there on, through dprorun's (DDP takes one comm hook)")

    def timed(self, inner: Callable, user: bool = False) -> Callable:
        """inner (the script's hook when `user`, else ours) timed per bucket in the profiled iterations; a
        script's hook has what it sends counted (runtime/hook_bytes.py)."""
        session = self.session
        if user and session.hook_bytes is None:
            from dprorun.runtime.hook_bytes import HookBytesMeter

            session.hook_bytes = HookBytesMeter(session, lambda: session.detail_active)
            session.hook_bytes.start()
        meter = session.hook_bytes if user else None

        def dpro_timed_comm_hook(state, bucket):
            self.buckets_reduced += 1
            if not session.detail_active:
                return inner(state, bucket)
            ddp_index = self.index  # now: a module that took the primary's role over became DDP 0
            record = CommRecord(session.iteration, ddp_index, bucket.index(), session.now_us())
            if inner is allreduce_mean:  # our own all-reduce: one callback does both jobs
                future = _allreduce_mean(state, bucket, record, session.now_us)
            else:
                future = meter.call_hook(inner, state, bucket) if meter is not None else inner(state, bucket)

                def done(fut):
                    record.done_us = session.now_us()
                    return fut.value()

                future = future.then(done)
            record.enqueued_us = session.now_us()
            key = (ddp_index, record.bucket)
            if key not in session.records.buckets:
                session.guard("reading the bucket layout", self._record_bucket, key, bucket)
            session.records.comm.append(record)
            return future

        if user:  # a copy of the module (copies.py) gets the script's hook back in DDP's list
            setattr(dpro_timed_comm_hook, USER_HOOK, inner)
        return own_hook(dpro_timed_comm_hook)

    def _record_bucket(self, key: tuple[int, int], bucket) -> None:
        buffer = bucket.buffer()
        names = [self.param_names.get(id(p), f"<unnamed {i}>") for i, p in enumerate(bucket.parameters())]
        entry = {"nbytes": buffer.numel() * buffer.element_size(), "numel": buffer.numel(),
                 "dtype": str(buffer.dtype).replace("torch.", ""), "params": names}
        if buffer.is_sparse:  # a sparse gradient's bucket: what gloo sends is its indices and values, not the table
            entry.update(sparse_bucket_fields(buffer, entry["nbytes"]))
        elif self.user_hook_name in COMPRESSING_HOOKS:  # the hook casts the bucket before sending it
            dtype, size = COMPRESSING_HOOKS[self.user_hook_name]
            entry.update(buffer_nbytes=entry["nbytes"], nbytes=buffer.numel() * size, wire_dtype=dtype)
        self.session.records.buckets[key] = entry


def _allreduce_mean(process_group, bucket, record=None, clock=None):
    """DDP's default semantics (average over ranks, divided before the sum as torch's allreduce_hook does),
    with the process group's own allreduce binding and a single future callback, which also stamps the
    completion time when a record is given.

    Cost: with any Python comm hook DDP copies gradients into the bucket without the division it otherwise
    fuses into that copy, so averaging takes one more pass over the gradients. Measured on a small CPU model
    (benchmarks/RESULTS.md) that is a few % of an iteration for the rest of the job; on GPU it is one small
    kernel. `--no-comm-hook` keeps DDP's built-in path (buckets then timed only by the profiler's spans).
    Dividing after the sum inside the callback instead was measured slower here: the callback holds the GIL."""
    group = resolve_group(process_group)
    tensor = bucket.buffer()
    tensor.div_(group.size())
    future = group.allreduce([tensor]).get_future()

    def finished(fut):
        if record is not None:
            record.done_us = clock()
        return fut.value()[0]

    return future.then(finished)


def allreduce_mean(process_group, bucket):
    return _allreduce_mean(process_group, bucket)


def _backend_name(ddp) -> str:
    """The transport of the module's group for the module's device (a group made without a backend is
    "undefined" to torch until its first collective: runtime/backends.py)."""
    from dprorun.runtime.backends import group_backend

    device = getattr(ddp, "device_type", None)
    for group in (getattr(ddp, "process_group", None), None):
        name = group_backend(group, device)
        if name != "unknown":
            return name
    return "unknown"


def _group_ranks(ddp) -> Optional[list[int]]:
    """The global ranks of the process group the DDP module all-reduces in (None: not readable)."""
    import torch.distributed as dist

    try:
        group = getattr(ddp, "process_group", None)
        return [int(r) for r in dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)]
    except Exception:
        return None


_ORIGINAL: dict[str, Callable] = {}


def patch_ddp_class(session: RankSession) -> None:
    """Patch DistributedDataParallel once per process so every instance gets a tracker."""
    import sys

    DDP = sys.modules["torch.nn.parallel.distributed"].DistributedDataParallel
    if getattr(DDP, "_dpro_patched", False):
        return
    DDP._dpro_patched = True
    _ORIGINAL["__init__"] = DDP.__init__
    _ORIGINAL["register_comm_hook"] = DDP.register_comm_hook
    _ORIGINAL["_register_builtin_comm_hook"] = DDP._register_builtin_comm_hook

    @functools.wraps(_ORIGINAL["__init__"])
    def __init__(self, *args, **kwargs):
        strategy = session.strategy if not session.disabled else None
        if strategy is not None:
            from dprorun.runtime import apply

            module = args[0] if args else kwargs.get("module")
            if module is not None:  # before DDP wraps it: DDP's hooks then see the compiled modules
                session.guard("applying compiled regions", apply.apply_compile, strategy, module,
                              session.strategy_applied, session.records.warnings)
            kwargs = session.guard("applying the strategy's bucket layout", apply.ddp_init_kwargs, strategy,
                                   _ORIGINAL["__init__"], args, kwargs, session.strategy_applied,
                                   session.records.warnings) or kwargs
        as_the_callers(_ORIGINAL["__init__"], self, *args, **kwargs)
        if session.disabled:
            return
        if strategy is not None:
            session.guard("applying re-computation", apply.apply_recompute, strategy, self.module,
                          session.strategy_applied, session.records.warnings)
            # last: autocast wraps whatever forward the model now has (a checkpointed one recomputes under it)
            session.guard("applying the strategy's precision", apply.apply_precision, strategy, self.module,
                          session.strategy_applied, session.records.warnings)
        session.guard("handing the job over to DistributedDataParallel", session.wrapper_built, "DDP model")
        tracker = session.guard("attaching to DistributedDataParallel", DDPTracker, session, self,
                                len(session.trackers))
        if tracker is not None:
            self._dpro_tracker = tracker
            session.trackers.append(tracker)

    @functools.wraps(_ORIGINAL["register_comm_hook"])
    def register_comm_hook(self, state, hook):
        tracker = getattr(self, "_dpro_tracker", None)
        if tracker is not None and tracker.hook_registered and not tracker.user_hook:
            return tracker.take_over_comm_hook(state, hook)  # ours went in with the window: the script's runs in it
        if tracker is not None and not tracker.hook_registered:
            tracker.user_hook = True
            tracker.user_hook_name = getattr(hook, "__name__", type(hook).__name__)
            hook = tracker.timed(hook, user=True)
            if tracker.ring is not None:
                session.records.warnings.append("the script registers its own comm hook: --comm-detail ring not applied")
        return _ORIGINAL["register_comm_hook"](self, state, hook)

    @functools.wraps(_ORIGINAL["_register_builtin_comm_hook"])
    def _register_builtin_comm_hook(self, comm_hook_type):
        tracker = getattr(self, "_dpro_tracker", None)
        if tracker is not None and tracker.hook_registered and not tracker.user_hook:
            # ours went in with the window and a C++ hook cannot run through it: torch's Python hook of the same
            # arithmetic (default_hooks) takes over, as a late register_comm_hook does
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            hook = {"ALLREDUCE": default_hooks.allreduce_hook,
                    "FP16_COMPRESS": default_hooks.fp16_compress_hook}.get(getattr(comm_hook_type, "name", ""))
            if hook is not None:
                return tracker.take_over_comm_hook(self.process_group, hook, f"built-in {comm_hook_type.name} "
                                                   f"(run as torch's {hook.__name__})")
        if tracker is not None:
            tracker.builtin_hook = True
            session.records.warnings.append("a built-in C++ comm hook is in use: bucket enqueue times are not "
                                    "recorded, only the profiler's collective spans")
        return _ORIGINAL["_register_builtin_comm_hook"](self, comm_hook_type)

    DDP.__init__ = __init__
    DDP.register_comm_hook = register_comm_hook
    DDP._register_builtin_comm_hook = _register_builtin_comm_hook
    _patch_group_teardown(session)


def _patch_group_teardown(session: RankSession) -> None:
    """`destroy_process_group()` of the default group first runs the end-of-window work that is still due
    (clock probes, calibration, gather, clean exchange): a script that ends inside the window or the clean
    iterations would otherwise leave no group for it."""
    import sys

    c10d = sys.modules["torch.distributed.distributed_c10d"]
    original = c10d.destroy_process_group
    if getattr(original, "_dpro_patched", False):
        return

    @functools.wraps(original)
    def destroy_process_group(group=None):
        if group is None or group is c10d.GroupMember.WORLD:
            session.guard("the end-of-window work before the group's teardown", session.before_group_teardown)
        return original(group)

    destroy_process_group._dpro_patched = True
    c10d.destroy_process_group = destroy_process_group
    distributed = sys.modules.get("torch.distributed")
    if distributed is not None and getattr(distributed, "destroy_process_group", None) is original:
        distributed.destroy_process_group = destroy_process_group


def patch_replicate(session: RankSession) -> None:
    """torch.distributed._composable.replicate: once its state has built the DDP (lazily, in the module's first
    forward), that DDP's tracker moves its hooks to the module the script calls (`DDPTracker.attach_to_replicated`)."""
    import sys

    state_class = getattr(sys.modules["torch.distributed._composable.replicate"], "_ReplicateState", None)
    if state_class is None or getattr(state_class, "_dpro_patched", False):
        return
    state_class._dpro_patched = True
    original = state_class.init

    @functools.wraps(original)
    def init(self, module, *args, **kwargs):
        first = not getattr(self, "has_initialized", True)
        original(self, module, *args, **kwargs)
        tracker = getattr(getattr(self, "_ddp", None), "_dpro_tracker", None)
        if first and tracker is not None:
            session.guard("attaching to replicate()", tracker.attach_to_replicated, module,
                          list(getattr(self, "_param_names", [])))

    state_class.init = init
