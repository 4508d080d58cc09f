"""Zero-code-change instrumentation of horovod.torch's DistributedOptimizer (stock Horovod).

Patched into `horovod.torch.optimizer` when it is imported, before the script builds its optimizer
(DistributedOptimizer copies `_DistributedOptimizer`'s methods into a new class when it is called):
  - `_allreduce_grad_async(p)`: a gradient is ready and its all-reduce is submitted (per tensor: enqueue);
  - the module's `synchronize(handle)`: the optimizer waits for each all-reduce in submission order; the
    return time closes that tensor's record (an upper bound of its completion; Horovod's own timeline has the
    exact transmission spans);
  - `step()`: its end is the iteration boundary (iteration k runs from the end of step k-1 to the end of
    step k); the optimizer's inner step is the update span (torch's global optimizer hooks).
Phase spans per iteration: forward0 = iteration start -> first gradient ready (forward, loss and the backward up
to the first gradient: Horovod's hook on it, `_make_hook`, in the step's last backward pass), backward0 = first
gradient ready -> last all-reduce submitted, update = the inner optimizer step.
Each tensor is reported as its own bucket (Horovod fuses tensors at run time; the fused responses are in the
timeline). At the end of the window ranks on other hosts ship their files to rank 0 over Horovod's own
collectives (runtime/gather.py: gather_horovod_to_rank0).
"""
from __future__ import annotations

import functools
import sys

from dprorun.layout import CommRecord, sparse_bucket_fields
from dprorun.runtime.copies import own_hook
from dprorun.runtime.horovod_timeline import WindowTimeline
from dprorun.runtime.session import RankSession
from dprorun.runtime.turns import StepTurns


class HorovodTracker:
    """Per-process recorder for horovod.torch optimizers (one per process, like the session)."""

    def __init__(self, session: RankSession):
        self.session = session
        self.iteration_start = session.now_us()
        self.first_ready = None
        self.last_ready = None
        self.pending: list[CommRecord] = []  # comm records waiting for their synchronize, in submission order
        self.index: dict[str, int] = {}
        self.timeline = WindowTimeline(session, "horovod.torch")
        self.watched_optimizers: set[int] = set()  # ids of the optimizers whose models watch_inference hooked
        self.hooked_models: set[int] = set()
        self.turns = StepTurns()  # DistributedOptimizers stepped in turn within a step (a GAN's two models)

    def optimizer_built(self) -> None:
        """The script built an hvd.DistributedOptimizer: the tracker joins the session's then, not when horovod.torch
        is imported (libraries import it and never use it: PyTorch-Ignite's idist, where Horovod is installed; an idle
        Horovod tracker took a DDP module's place as the primary, and no iteration was counted)."""
        if self not in self.session.trackers:
            self.session.wrapper_built("model (an hvd.DistributedOptimizer)")
            self.session.trackers.append(self)

    # ---- what DDPTracker also offers the session --------------------------------------------------------
    def describe(self) -> dict:
        return {"ddp": 0, "framework": "horovod", "user_comm_hook": False, "builtin_comm_hook": False,
                "timed_buckets": True, "backend": "horovod"}

    def detail_tier_started(self) -> None:
        self.timeline.start()

    def window_stopped(self) -> None:
        self.timeline.stop()

    def stop_param_hooks(self) -> None:  # end of the detailed tier
        self.timeline.stop()

    # ---- records ----------------------------------------------------------------------------------------
    def submitted(self, optimizer, p) -> None:
        self.submitted_group(optimizer, [p])

    def gradient_ready(self) -> None:
        """A gradient of the step's last backward pass is ready (Horovod's hook on it is about to run): the first
        one ends forward0. With groups= a group is submitted only once its last gradient is ready, so the first
        submission came late in the backward (with groups=2, 15.6 ms of "forward" against 6.6 without)."""
        if self.session.detail_active and self.first_ready is None:
            self.first_ready = self.session.now_us()

    def submitted_group(self, optimizer, ps) -> None:
        """One all-reduce of the tensors `ps` (one parameter; or a group of a strategy's or the script's groups=,
        which Horovod fuses into one grouped all-reduce: one record, its bytes the group's, named after its first
        parameter)."""
        session = self.session
        if not session.detail_active:
            return
        now = session.now_us()
        names = [optimizer._parameter_names.get(p, f"param{len(self.index) + k}") for k, p in enumerate(ps)]
        name = names[0]
        if self.first_ready is None:
            self.first_ready = now
        self.last_ready = now
        index = self.index.setdefault(name, len(self.index))
        if session.iteration < session.kineto_start_iteration + session.cfg.kineto_iters:
            session.records.grad_ready.append((session.iteration, name, now))
        key = (0, index)
        if key not in session.records.buckets:
            sizes = [p.numel() * p.element_size() for p in ps]
            session.records.buckets[key] = {"nbytes": sum(sizes), "numel": sum(p.numel() for p in ps),
                                            "dtype": str(ps[0].dtype).replace("torch.", ""), "params": names}
            grad = ps[0].grad
            if len(ps) == 1 and grad is not None and grad.is_sparse and not optimizer.sparse_as_dense:
                session.records.buckets[key].update(sparse_bucket_fields(grad, sizes[0]))
            else:
                sent = _compressed_nbytes(optimizer, ps)
                if sent != sum(sizes):  # a compression (hvd.Compression.fp16) sends fewer bytes than the gradients
                    session.records.buckets[key].update(buffer_nbytes=sum(sizes), nbytes=sent)
            session.records.params.setdefault(0, {"order": [], "bytes": {}, "bucket_cap_mb": 0.0})
            for member, nbytes in zip(names, sizes):
                session.records.params[0]["order"].append(member)
                session.records.params[0]["bytes"][member] = nbytes
        record = CommRecord(session.iteration, 0, index, now, session.now_us())
        session.records.comm.append(record)
        self.pending.append(record)

    def synchronized_one(self) -> None:
        if self.pending:
            self.pending.pop(0).done_us = self.session.now_us()

    def watch_inference(self, optimizer) -> None:
        """Count the forward passes of the trained model that train nothing (a validation pass between steps: it
        lengthens the iteration it falls in; trace/rundir.inference_set_aside sets such iterations aside, as for
        DDP). Horovod wraps the optimizer, not the model: the trained model is found once per optimizer, after its
        first step, as the outermost modules holding its parameters (a forward pre-hook on those only: a hook on
        every module would run in every layer's call; each model hooked once, where two optimizers share it)."""
        self.watched_optimizers.add(id(optimizer))
        try:
            roots = trained_roots(optimizer)
        except Exception as exc:  # not worth the profile: say it and go on
            self.session.records.warnings.append(f"validation passes not counted (the trained model not found: "
                                                 f"{type(exc).__name__}: {exc})")
            return
        for root in roots:
            if id(root) not in self.hooked_models:
                self.hooked_models.add(id(root))
                try:
                    root.register_forward_pre_hook(own_hook(self._pre_forward))
                except RuntimeError as exc:  # a TorchScript module takes no hooks
                    self.session.records.warnings.append(f"validation passes not counted on a model that takes no "
                                                         f"forward hook ({type(root).__name__}: {exc})")

    def _pre_forward(self, module, inputs) -> None:
        import torch

        if not (torch.is_grad_enabled() and module.training):
            self.session.records.count_inference_pass(self.session.iteration)

    def step_done(self, optimizer) -> None:
        """An optimizer's step returned: the iteration ends here, unless optimizers take turns in the script's step
        (a GAN's discriminator and generator: runtime/turns.StepTurns) and another one's step closes it."""
        session = self.session
        if id(optimizer) not in self.watched_optimizers:
            self.watch_inference(optimizer)
        if not self.turns.ends_with(id(optimizer)):
            return
        now = session.now_us()
        if session.detail_active and self.first_ready is not None:
            session.mark("forward0", self.iteration_start, self.first_ready)
            session.mark("backward0", self.first_ready, self.last_ready)
        self.first_ready = self.last_ready = None
        self.pending.clear()
        session.begin_iteration()
        self.iteration_start = session.now_us() if session.phase != "done" else now


def trained_roots(optimizer) -> list:
    """The outermost torch modules (among all the process holds) whose parameters include the optimizer's: the
    model the script calls (a wrapper holding it included; a frozen teacher, holding none of them, left out)."""
    import gc

    import torch

    trained = {id(p) for group in optimizer.param_groups for p in group["params"]}
    holders = []
    for candidate in gc.get_objects():
        try:  # the type alone: isinstance reads __class__, which a deprecated module attribute answers with a warning
            if issubclass(type(candidate), torch.nn.Module) and any(id(p) in trained for p in candidate.parameters()):
                holders.append(candidate)
        except Exception:  # an object half built or of a class whose attributes raise: not the trained model
            continue
    children = {id(child) for m in holders for child in m.children()}
    return [m for m in holders if id(m) not in children]


def _compressed_nbytes(optimizer, ps) -> int:
    """The bytes the optimizer's compression sends for the tensors `ps` (its compress() of an empty tensor of each
    one's dtype gives the element size it sends)."""
    import torch

    compression = getattr(optimizer, "_compression", None)
    total = 0
    for p in ps:
        size = p.element_size()
        if compression is not None:
            size = compression.compress(torch.empty(0, dtype=p.dtype))[0].element_size()
        total += p.numel() * size
    return total


GROUPS_ARG = 3  # _DistributedOptimizer.__init__(params, named_parameters, compression, backward_passes_per_step,
#                op, gradient_predivide_factor, groups, ...): hvd.DistributedOptimizer passes them positionally


def _with_groups(strategy, named_parameters, args: tuple, kwargs: dict, session: RankSession) -> tuple:
    """(args, kwargs) with groups= from the strategy's parameter-name groups (grouped allreduce: each group is
    fused into one allreduce), unless the script chose its own groups."""
    given = args[GROUPS_ARG] if len(args) > GROUPS_ARG else kwargs.get("groups")
    if given is not None:
        session.records.warnings.append("the script sets DistributedOptimizer groups: the strategy's groups not applied")
        return args, kwargs
    by_name = dict(named_parameters or [])
    missing = [n for g in strategy.horovod_groups for n in g if n not in by_name]
    if missing:
        session.records.warnings.append(f"strategy groups name parameters this model lacks ({missing[:3]}): not applied")
        return args, kwargs
    groups = [[by_name[n] for n in group] for group in strategy.horovod_groups]
    if len(args) > GROUPS_ARG:
        args = args[:GROUPS_ARG] + (groups,) + args[GROUPS_ARG + 1:]
    else:
        kwargs = dict(kwargs, groups=groups)
    session.strategy_applied["horovod_groups"] = [len(g) for g in strategy.horovod_groups]
    return args, kwargs


def patch_horovod(session: RankSession) -> None:
    """Patch horovod.torch.optimizer once per process (its tracker joins the session at the first
    DistributedOptimizer: HorovodTracker.optimizer_built)."""
    module = sys.modules["horovod.torch.optimizer"]
    cls = module._DistributedOptimizer
    if getattr(cls, "_dpro_patched", False):
        return
    cls._dpro_patched = True
    tracker = HorovodTracker(session)
    original_async = cls._allreduce_grad_async
    original_grouped = getattr(cls, "_grouped_allreduce_grad_async", None)  # Horovod >= 0.22: groups=
    original_step, original_init = cls.step, cls.__init__
    original_make_hook = cls._make_hook

    @functools.wraps(original_init)
    def __init__(self, params, named_parameters, compression, *args, **kwargs):
        tracker.optimizer_built()
        if session.iteration >= 0 and session.phase in ("active", "clean"):  # after steps: another model's optimizer
            session.guard("ending the window at a new DistributedOptimizer", session.primary_replaced,
                          session.iteration, "model (a new hvd.DistributedOptimizer)", False)
        strategy = session.strategy if not session.disabled else None
        if strategy is not None and strategy.horovod_groups:
            if named_parameters is not None:  # often a generator: read it once, pass the list on
                named_parameters = list(named_parameters)
            args, kwargs = session.guard("applying the strategy's Horovod groups", _with_groups, strategy,
                                         named_parameters, args, kwargs, session) or (args, kwargs)
        return original_init(self, params, named_parameters, compression, *args, **kwargs)

    original_sync_fn = module.synchronize

    @functools.wraps(original_async)
    def _allreduce_grad_async(self, p):
        session.guard("recording a Horovod all-reduce", tracker.submitted, self, p)
        result = original_async(self, p)
        if isinstance(result, tuple) and len(result) == 2 and callable(result[0]):
            gathered, ctx = result  # a sparse gradient's all-gather: step() calls it, not synchronize(handle)

            def handle():
                output = gathered()
                tracker.synchronized_one()
                return output
            return handle, ctx
        return result

    if original_grouped is not None:
        @functools.wraps(original_grouped)
        def _grouped_allreduce_grad_async(self, ps):
            session.guard("recording a Horovod grouped all-reduce", tracker.submitted_group, self, ps)
            return original_grouped(self, ps)

        cls._grouped_allreduce_grad_async = _grouped_allreduce_grad_async

    @functools.wraps(original_make_hook)
    def _make_hook(self, p):
        hook = original_make_hook(self, p)

        def timed_hook(*ignore):
            if self._allreduce_delay.get(p) == 1:  # the step's last backward pass: the gradient goes out now
                session.guard("timing a gradient", tracker.gradient_ready)
            return hook(*ignore)
        return timed_hook

    @functools.wraps(original_step)
    def step(self, closure=None):
        result = original_step(self, closure)
        session.guard("closing a Horovod step", tracker.step_done, self)
        return result

    @functools.wraps(original_sync_fn)
    def synchronize(handle):
        output = original_sync_fn(handle)
        tracker.synchronized_one()
        return output

    cls.__init__ = __init__
    cls._make_hook = _make_hook
    cls._allreduce_grad_async = _allreduce_grad_async
    cls.step = step
    module.synchronize = synchronize
    _patch_shutdown(session)


def _patch_shutdown(session: RankSession) -> None:
    """`hvd.shutdown()` first runs the end-of-window work still due, as destroy_process_group does for DDP."""
    mpi_ops = sys.modules.get("horovod.torch.mpi_ops")
    if mpi_ops is None or getattr(mpi_ops.shutdown, "_dpro_patched", False):
        return
    original = mpi_ops.shutdown

    @functools.wraps(original)
    def shutdown(*args, **kwargs):
        session.guard("the end-of-window work before Horovod's shutdown", session.before_group_teardown)
        return original(*args, **kwargs)

    shutdown._dpro_patched = True
    for name in ("horovod.torch.mpi_ops", "horovod.torch"):
        target = sys.modules.get(name)
        if target is not None and getattr(target, "shutdown", None) is original:
            target.shutdown = shutdown
