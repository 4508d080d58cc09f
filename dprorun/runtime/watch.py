"""What a torch job's script does with torch.distributed outside the wrappers the hooks profile: processes it
spawns itself, FSDP wrappers it builds, collectives it calls by hand, its own rendezvous address. Nothing here
changes what the calls do; what was seen is counted so that a job that profiled nothing says why
(`nothing_to_profile`), and a rendezvous that can only time out is named when it is made."""
from __future__ import annotations

import functools
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from dprorun.runtime.log import warn

SUPPORTED_WRAPPERS = ("torch.nn.parallel.DistributedDataParallel (directly, or through Lightning, Hugging Face "
                      "Trainer or Accelerate), gradients the script all-reduces or reduce-scatters itself "
                      "(torch.distributed.all_reduce, reduce_scatter between loss.backward() and the optimizer's step; "
                      "the parameters all-gathered after a sharded step), FSDP2's fully_shard "
                      "on the CPU, horovod.torch.DistributedOptimizer and "
                      "horovod.tensorflow's all-reduce inside a tf.function step (DistributedGradientTape, "
                      "DistributedOptimizer)")
# the torch.distributed calls a script makes itself when it shares gradients without a wrapper
# (torch 2.13 names all_gather_into_tensor and reduce_scatter_tensor deprecated aliases of its all_gather_single and
# reduce_scatter_single, which call those through distributed_c10d, not through these patched names: one count a call)
SCRIPT_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter",
                      "reduce_scatter_tensor", "reduce_scatter_single", "reduce", "broadcast")
FSDP_PACKAGE = "torch.distributed.fsdp"  # its wrappers' gathers and reduce-scatters are no script's own
# other torch.distributed calls a script makes in its steps (an MoE layer's all_to_all, a barrier, metrics gathered
# as objects, torch.distributed.checkpoint's planning: gather_object, scatter_object_list): timed with the ones above
# (`ScriptUse.timed`), never taken for a way of sharing gradients
TIMED_COLLECTIVES = ("all_to_all_single", "all_to_all", "barrier", "monitored_barrier", "all_gather_object",
                     "broadcast_object_list", "gather_object", "scatter_object_list", "gather", "scatter")
# the point-to-point calls a script makes in its steps (a halo swapped with its neighbours, activations handed on by
# hand), timed likewise: blocking send and recv as they run, batch_isend_irecv at its call and at each of its
# requests' wait(); isend and irecv (ASYNC_POINT_TO_POINT) too, by stand-ins equal to torch's own (P2POp checks its op
# with `in [isend, irecv]`), P2POp keeping torch's own (batch_isend_irecv tells a send by `op.op is isend`)
POINT_TO_POINT = ("send", "recv", "batch_isend_irecv")
ASYNC_POINT_TO_POINT = ("isend", "irecv")
# torch's functional collectives (torch.distributed._functional_collectives: a tensor returned, waited for where it
# is used), which a script may average its gradients with: counted where the script calls them (not DTensor's or
# another torch module's), named when nothing was profiled; not profiled
FUNCTIONAL_MODULE = "torch.distributed._functional_collectives"
FUNCTIONAL_COLLECTIVES = ("all_reduce", "all_reduce_coalesced", "all_gather_tensor", "all_gather_into_tensor_coalesced",
                          "reduce_scatter_tensor", "reduce_scatter_tensor_coalesced", "all_to_all_single", "broadcast")
# horovod.torch's, timed likewise (the loss averaged for logging, features gathered for a contrastive loss): the
# DistributedOptimizer and broadcast_parameters call horovod.torch.mpi_ops directly, never these names
HOROVOD_COLLECTIVES = ("allreduce", "allreduce_", "grouped_allreduce", "allgather", "broadcast", "broadcast_",
                       "alltoall", "reducescatter", "barrier", "join", "broadcast_object", "allgather_object",
                       # their async forms, a script's gradients shared by hand (runtime/gradient_calls.py): each
                       # returns a handle, done at hvd.synchronize(handle) (`_synchronize_told`)
                       "allreduce_async", "allreduce_async_", "grouped_allreduce_async", "grouped_allreduce_async_",
                       "reducescatter_async", "allgather_async")
# horovod.torch.mpi_ops' autograd Functions behind those: their backward runs a collective of its own
HOROVOD_AUTOGRAD_FUNCTIONS = {"HorovodAllgather": "allgather", "HorovodGroupedAllgather": "grouped_allgather",
                              "HorovodAllreduce": "allreduce", "HorovodGroupedAllreduce": "grouped_allreduce",
                              "HorovodAlltoall": "alltoall", "HorovodBroadcast": "broadcast",
                              "HorovodReducescatter": "reducescatter",
                              "HorovodGroupedReducescatter": "grouped_reducescatter"}


@dataclass
class ScriptUse:
    """torch.distributed use seen in the script (counts of calls; the process group as it was made)."""
    spawned_processes: int = 0  # by torch.multiprocessing.spawn (in a one-process launch, ranks: runtime/spawned.py)
    subprocess_scripts: list[str] = field(default_factory=list)  # scripts run in child interpreters (bootstrap)
    fsdp_wrappers: int = 0  # FullyShardedDataParallel / fully_shard calls
    problems: list[str] = field(default_factory=list)  # what the rank's records keep as warnings (events.json)
    # a model split across ranks: what was built ("tensor-parallel plan(s) (...)", "pipeline stage(s) (...)") -> count
    model_splits: dict[str, int] = field(default_factory=dict)
    collectives: dict[str, int] = field(default_factory=dict)  # torch.distributed.<name> calls the script made
    # gradient collectives (all_reduce, ...) the script called after a backward, and optimizer steps after such calls
    # (runtime/collectives.py): calls and no step is an update by hand, which only a DDP model gets profiled with
    gradient_calls_after_backward: int = 0
    steps_after_gradient_calls: int = 0
    process_group: str = ""  # "a gloo process group of 2 ranks", once init_process_group returned
    horovod_initialised: bool = False  # hvd.init (horovod.torch) returned
    # told of each such call (name, args, kwargs) before it runs: runtime/hook_bytes.py counts a comm hook's bytes
    listeners: list[Callable[[str, tuple, dict], None]] = field(default_factory=list)
    # told when a collective called from outside dprorun returns ("torch.distributed.all_gather", µs the call took;
    # an async_op call: its launch): the session keeps the window's (beside the gradient buckets, runtime/session.py)
    timed: Optional[Callable[[str, float], None]] = None
    # told when a torch.distributed call of the script's returned (name, args, kwargs, its result, µs, whether the
    # call was made asynchronous to be waited for here): True where it was one of the gradients' buckets
    # (runtime/collectives.py), which is then not timed as the script's own
    returned: Optional[Callable[[str, tuple, dict, object, float, bool], bool]] = None
    # asked before a synchronous call: should it be made with async_op=True and waited for here (what torch's
    # synchronous path does itself), so that its Work tells when it completed (an NCCL call returns once enqueued)?
    wants_work: Optional[Callable[[str, tuple, dict], bool]] = None
    work_waited: Optional[Callable[[], None]] = None  # told when such a call's wait returned
    synchronized: Optional[Callable[[object], None]] = None  # told when hvd.synchronize(handle) returned
    # what this rank does alone now, and in which thread ("rank 0 times the model's compute variants alone":
    # runtime/variants.py): a torch.distributed call that thread makes then raises RanksNeededError, where it would
    # wait for ranks that never come (the script's other threads go on as they were)
    alone: str = ""
    alone_thread: int = 0


class RanksNeededError(RuntimeError):
    """A torch.distributed call made while the rank runs alone (`ScriptUse.alone`): a model whose forward swaps a
    halo with its neighbours, or routes tokens to experts by all_to_all, hung --autotune's variant timing on rank 0
    for good (the other ranks wait at dprorun's barrier)."""


def _refused_alone(use: ScriptUse, label: str) -> None:
    if use.alone and threading.get_ident() == use.alone_thread:
        raise RanksNeededError(f"the model's forward calls {label}, which needs the other ranks: {use.alone}")


def read_subprocess_scripts(folder: str) -> list[str]:
    """The command lines of scripts the rank ran in child interpreters (runtime/bootstrap notes them there)."""
    from dprorun.layout import SUBPROCESS_SCRIPTS_FILE

    try:
        with open(os.path.join(folder, SUBPROCESS_SCRIPTS_FILE)) as f:
            return [line.strip() for line in f if line.strip()]
    except OSError:
        return []


def subprocess_script_advice(script: str, np: str) -> str:
    """Where a rank's training went when its process ran it in a child interpreter (runtime/bootstrap notes them),
    and the launch that profiles it: the rank's warning and the launcher's last line say the same."""
    return (f"the rank's process ran `python {script}` in a process of its own (a wrapper's subprocess, or a "
            f"launcher's), which dprorun does not profile: it profiles the processes it launches; run the training "
            f"script itself: `dprorun -np {np} python {script}`")


def nothing_to_profile(use: ScriptUse) -> str:
    """What a rank that never met a supported wrapper saw instead: processes the script spawned as its ranks,
    FSDP, collectives called by hand (gradients averaged in the script), a bare process group, or nothing."""
    if use.spawned_processes:
        return (f"nothing to profile: the script started {use.spawned_processes} process(es) of its own "
                f"(torch.multiprocessing.spawn), and none wrote a rank's records: where dprorun launched one process "
                f"(`dprorun python <script>`), each it starts is profiled as a rank once it calls init_process_group "
                f"and trains a wrapper the hooks support (not one forked from a process that trained); a larger "
                f"launch leaves them as they are. The job ran unprofiled")
    if use.subprocess_scripts:
        return f"nothing to profile: {subprocess_script_advice(use.subprocess_scripts[0], 'N')}. The job ran unprofiled"
    if use.horovod_initialised and not (use.process_group or use.collectives):
        return ("nothing to profile: horovod.torch was initialised, but no hvd.DistributedOptimizer was built, and no "
                "optimizer step followed horovod.torch calls (allreduce, grouped_allreduce, their async forms, "
                "reducescatter) made after or inside a backward pass that carried at least half of its gradients: "
                "wrapping the optimizer in hvd.DistributedOptimizer, or sharing the gradients by such calls between "
                "loss.backward() and the step, lets dprorun profile and replay it. The job ran unprofiled")
    seen = []
    if use.fsdp_wrappers:
        seen.append(f"{use.fsdp_wrappers} FSDP wrapper(s) (FullyShardedDataParallel / fully_shard)")
    seen += [f"{count} {what}" for what, count in use.model_splits.items()]
    if use.collectives:
        calls = ", ".join(f"torch.distributed.{name} x{count}" for name, count in sorted(use.collectives.items()))
        seen.append(f"collectives called by the script itself ({calls})")
    functional = any(name.startswith("_functional_collectives.") for name in use.collectives)
    if use.process_group:
        seen.append(use.process_group)
    found = ("it saw " + "; ".join(seen)) if seen else "no distributed training was seen"
    advice = ""
    backend = launch_hint(use)
    launched_as = os.environ.get("DPRO_BACKEND", "")
    if use.process_group and launched_as == "tf":
        advice = (" The script trains with torch.distributed, which --backend tf does not profile: launch it without "
                  "--backend (dprorun's default profiles DistributedDataParallel).")
    elif backend:
        advice = f" {backend}"
    elif use.model_splits:
        advice = (" dprorun profiles and replays data parallelism (each rank a whole model): a model split across the "
                  "ranks (tensor or pipeline parallelism) is neither profiled nor modelled.")
    elif use.fsdp_wrappers:
        advice = (" FSDP is profiled and replayed on the CPU (gloo), where each of its gathers and reduce-scatters "
                  "holds the rank until it is done; on GPUs FSDP overlaps them with the compute on streams of its "
                  "own, which dprorun does not model.")
    elif functional:
        advice = (" torch's functional collectives (torch.distributed._functional_collectives: a tensor returned and "
                  "waited for where it is used) are not profiled; the same gradients averaged by "
                  "torch.distributed.all_reduce between loss.backward() and the optimizer's step (async_op=True and "
                  "a wait, for overlap), or a model wrapped in DistributedDataParallel, are profiled and replayed.")
    elif use.gradient_calls_after_backward and not use.steps_after_gradient_calls:
        advice = (f" The script called {use.gradient_calls_after_backward} of them after its backward passes, and no "
                  "torch.optim optimizer ever stepped after them (parameters updated by hand, or by an optimizer of "
                  "the script's own that is no torch.optim.Optimizer): dprorun profiles gradients shared by hand up "
                  "to an optimizer's step; a model wrapped in DistributedDataParallel is profiled and replayed "
                  "whatever updates it.")
    elif use.collectives:
        advice = (" dprorun profiles gradients the script all-reduces or reduce-scatters itself between "
                  "loss.backward() and the optimizer's step (torch.distributed.all_reduce, reduce_scatter); these "
                  "collectives were not that (other "
                  "collectives, gradients from torch.func or autograd.grad with no backward() call, or no optimizer "
                  "step after them). Wrapping the model in DistributedDataParallel lets dprorun profile and replay "
                  "it.")

    return (f"nothing to profile: the job never built a wrapper the hooks support ({SUPPORTED_WRAPPERS}); "
            f"{found}.{advice} The job ran unprofiled, as under torchrun")


def launch_hint(use: ScriptUse, failed: bool = False) -> str:
    """The launch that fits a script which loaded another framework's distributed API under torch elastic (dprorun's
    default backend) and never used torch.distributed (TensorBoard loads TensorFlow): each rank ran it alone
    (`failed`: a rank raised, an MXNet kvstore without its roles, a TensorFlow cluster resolver without TF_CONFIG).
    TensorFlow without TF_CONFIG, horovod without horovodrun, MXNet without its roles; "" where none applies."""
    if use.process_group or use.collectives or use.fsdp_wrappers or use.model_splits:
        return ""
    alone = "" if failed else "each rank ran it alone here; "
    if "horovod.tensorflow" in sys.modules and "HOROVOD_RANK" not in os.environ:
        what, launch = "horovod.tensorflow, which needs horovodrun", "--backend horovod -np N"
    elif "tensorflow" in sys.modules and not os.environ.get("TF_CONFIG"):
        what, launch = ("TensorFlow, whose MultiWorkerMirroredStrategy reads each worker's TF_CONFIG, which only "
                        "`--backend tf` sets"), "--backend tf -np N"
    elif "mxnet" in sys.modules and not os.environ.get("DMLC_ROLE"):
        what, launch = "MXNet, whose kvstore needs a scheduler and servers", "--backend mxnet -np N --servers S"
    else:
        return ""
    said = f"the script uses {what}: {alone}launch it with `dprorun {launch} ...`"
    return said if failed else f"{said[0].upper()}{said[1:]}."


def watch_spawns(use: ScriptUse, launched_world: int, profiled_entry: Callable[[Callable, int], Callable]) -> None:
    """Processes the script starts itself with torch.multiprocessing.spawn / start_processes (the DDP tutorial's
    shape): counted; where dprorun launched this one process alone (`dprorun python train.py`), each runs the
    script's function through `profiled_entry` (runtime/bootstrap.py), which makes it a profiled rank (said at the
    spawn). Processes spawned by ranks of a larger launch are helpers of those ranks: left as they are (said too)."""
    module = sys.modules["torch.multiprocessing.spawn"]
    start_processes = module.start_processes

    @functools.wraps(start_processes)
    def counted(fn, args=(), nprocs=1, *more, **kwargs):
        if launched_world != 1:
            if not use.spawned_processes:
                warn(f"the script is starting {nprocs} process(es) of its own (torch.multiprocessing.spawn) in each of "
                     f"the {launched_world} processes dprorun launched: left as they are (helpers of each rank). If "
                     "they are the job's ranks (init_process_group in them), launch one process, `dprorun python "
                     "<script>`: each it starts is then profiled as a rank")
            use.spawned_processes += int(nprocs)
            return start_processes(fn, args, nprocs, *more, **kwargs)
        if not use.spawned_processes:
            warn(f"the script is starting {nprocs} process(es) of its own (torch.multiprocessing.spawn): each that "
                 "trains is profiled as a rank (the rank and world size it gives init_process_group)")
        use.spawned_processes += int(nprocs)
        return start_processes(profiled_entry(fn, nprocs), args, nprocs, *more, **kwargs)

    module.start_processes = counted


def watch_torch_distributed(use: ScriptUse) -> None:
    """init_process_group: a rendezvous at an address of the script's own (init_method="tcp://host:port") under a
    launcher whose agent hosts the store (TORCHELASTIC_USE_AGENT_STORE, as torchrun and dprorun set) makes torch
    connect to host:port as a client nobody serves, and the ranks wait out the timeout (30 min by default): said
    at the call, with the fix; the group made is noted. Collectives called through the module (dist.all_reduce,
    ...) are counted: the script's own, and any a wrapper makes that way (the counts are said only when no
    supported wrapper was built)."""
    module = sys.modules["torch.distributed"]
    init_process_group = getattr(module, "init_process_group", None)
    if init_process_group is None:
        return

    @functools.wraps(init_process_group)  # its signature stays readable (inspect follows __wrapped__)
    def watched(*args, **kwargs):
        method = kwargs.get("init_method") or (args[1] if len(args) > 1 else None)
        _warn_own_rendezvous(method)
        _warn_torchrun_script_under_horovodrun(method, kwargs)
        result = init_process_group(*args, **kwargs)
        try:
            name = str(module.get_backend())
            kind = "" if name == "undefined" else f"{name} "  # made without a backend: chosen per device later
            use.process_group = f"a {kind}process group of {module.get_world_size()} ranks"
        except Exception:
            pass
        return result

    module.init_process_group = watched
    for name in SCRIPT_COLLECTIVES + TIMED_COLLECTIVES:
        if callable(getattr(module, name, None)):
            setattr(module, name, _counted_collective(module, name, use, counted=name in SCRIPT_COLLECTIVES))
    for name in POINT_TO_POINT:
        if callable(getattr(module, name, None)):
            setattr(module, name, _timed_point_to_point(module, name, use))
    _time_isend_and_irecv(module, use)


class _TimedRequest:
    """A request the script's batch_isend_irecv returned, its wait() timed for `use.timed`; all else the request's."""
    __slots__ = ("_request", "_use", "_label")

    def __init__(self, request, use: ScriptUse, label: str):
        self._request, self._use, self._label = request, use, label

    def wait(self, *args, **kwargs):
        return _timed_call(self._use, self._label, self._request.wait, *args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._request, name)


def _timed_point_to_point(module, name: str, use: ScriptUse):
    """`module.name` (POINT_TO_POINT) timed for `use.timed` where the caller is no module of dprorun's; the requests
    of batch_isend_irecv timed at their wait."""
    call = getattr(module, name)
    label = f"{module.__name__}.{name}"
    compiler = sys.modules.get("torch.compiler")

    @functools.wraps(call)
    def timed(*args, **kwargs):
        _refused_alone(use, label)
        if use.timed is None or (compiler is not None and compiler.is_compiling()) or \
                sys._getframe(1).f_globals.get("__name__", "").startswith("dprorun."):
            return call(*args, **kwargs)
        result = _timed_call(use, label, call, *args, **kwargs)
        if name == "batch_isend_irecv" and isinstance(result, list):
            return [_TimedRequest(request, use, label) for request in result]
        return result

    return timed


class _TimedAsyncPointToPoint:
    """torch.distributed.isend / irecv as the script calls them: the call and its request's wait() timed for
    `use.timed` (where the caller is no module of dprorun's), equal to torch's own function."""

    def __init__(self, call, use: ScriptUse, label: str):
        functools.update_wrapper(self, call)
        self.torchs_own, self._use, self._label = call, use, label
        self._compiler = sys.modules.get("torch.compiler")

    def __eq__(self, other) -> bool:
        return other is self or other is self.torchs_own

    def __hash__(self) -> int:
        return hash(self.torchs_own)

    def __call__(self, *args, **kwargs):
        _refused_alone(self._use, self._label)
        if self._use.timed is None or (self._compiler is not None and self._compiler.is_compiling()) or \
                sys._getframe(1).f_globals.get("__name__", "").startswith("dprorun."):
            return self.torchs_own(*args, **kwargs)
        request = _timed_call(self._use, self._label, self.torchs_own, *args, **kwargs)
        return None if request is None else _TimedRequest(request, self._use, self._label)


def _time_isend_and_irecv(module, use: ScriptUse) -> None:
    """isend and irecv replaced by their timed stand-ins; P2POp given one keeps torch's own function as its op."""
    for name in ASYNC_POINT_TO_POINT:
        call = getattr(module, name, None)
        if callable(call) and not isinstance(call, _TimedAsyncPointToPoint):
            setattr(module, name, _TimedAsyncPointToPoint(call, use, f"{module.__name__}.{name}"))
    p2p_op = getattr(module, "P2POp", None)
    if p2p_op is None or getattr(p2p_op.__init__, COUNTED, False):
        return
    init = p2p_op.__init__

    @functools.wraps(init)
    def keeping_torchs_own(self, *args, **kwargs):
        if args and isinstance(args[0], _TimedAsyncPointToPoint):
            args = (args[0].torchs_own,) + args[1:]
        elif isinstance(kwargs.get("op"), _TimedAsyncPointToPoint):
            kwargs["op"] = kwargs["op"].torchs_own
        init(self, *args, **kwargs)

    setattr(keeping_torchs_own, COUNTED, True)
    p2p_op.__init__ = keeping_torchs_own


def watch_functional_collectives(use: ScriptUse) -> None:
    """The script's own calls of torch's functional collectives (FUNCTIONAL_COLLECTIVES) counted, under
    "_functional_collectives.<name>"; calls made by torch's modules (DTensor's redistributions) are not the script's."""
    module = sys.modules[FUNCTIONAL_MODULE]
    for name in FUNCTIONAL_COLLECTIVES:
        collective = getattr(module, name, None)
        if callable(collective) and not getattr(collective, COUNTED, False):
            setattr(module, name, _counted_functional(collective, name, use))


def _counted_functional(collective, name: str, use: ScriptUse):
    key = f"_functional_collectives.{name}"

    @functools.wraps(collective)
    def counted(*args, **kwargs):
        _refused_alone(use, f"{FUNCTIONAL_MODULE}.{name}")
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if not caller.startswith(("torch.", "dprorun.")):
            use.collectives[key] = use.collectives.get(key, 0) + 1
        return collective(*args, **kwargs)

    setattr(counted, COUNTED, True)
    return counted


def watch_horovod_torch(use: ScriptUse) -> None:
    """horovod.torch's collectives called by the script (HOROVOD_COLLECTIVES): timed as torch.distributed's are;
    and the backward of those autograd runs back through (hvd.allgather's is an all-reduce that reaches
    horovod.torch.mpi_ops directly: it was replayed as compute without a word), named "<collective> (backward)"."""
    module = sys.modules["horovod.torch"]
    init = getattr(module, "init", None)
    if callable(init) and not hasattr(init, "__wrapped__"):
        module.init = _lone_horovod_said(init, module, use)
    for name in HOROVOD_COLLECTIVES:
        if callable(getattr(module, name, None)):
            setattr(module, name, _counted_collective(module, name, use, counted=False))
    if callable(getattr(module, "synchronize", None)):
        module.synchronize = _synchronize_told(module.synchronize, use)
    mpi_ops = sys.modules.get("horovod.torch.mpi_ops")
    for function_name, name in HOROVOD_AUTOGRAD_FUNCTIONS.items():
        function = getattr(mpi_ops, function_name, None)
        if function is not None and callable(getattr(function, "backward", None)):
            function.backward = staticmethod(_timed_backward(function.backward, f"{module.__name__}.{name}", use))


def _synchronize_told(synchronize, use: ScriptUse):
    """hvd.synchronize(handle), `use.synchronized` told of the handle once it returned (an async call's end)."""
    @functools.wraps(synchronize)
    def told(handle, *args, **kwargs):
        result = synchronize(handle, *args, **kwargs)
        if use.synchronized is not None:
            try:
                use.synchronized(handle)
            except Exception:  # a listener never reaches the script's call
                pass
        return result

    return told


def _lone_horovod_said(init, module, use: ScriptUse):
    """hvd.init in a rank that torch elastic launched (dprorun's default backend: RANK and WORLD_SIZE, no
    horovodrun): each rank runs Horovod alone (hvd.size() 1), training a model of its own; it ran so without a word
    and was profiled as a job of one-rank trainings. Said at the call and kept in the rank's records."""
    @functools.wraps(init)
    def watched(*args, **kwargs):
        result = init(*args, **kwargs)
        use.horovod_initialised = True
        launched = int(os.environ.get("WORLD_SIZE", "1") or 1)
        try:
            alone = "HOROVOD_RANK" not in os.environ and launched > 1 and module.size() == 1
        except Exception:
            alone = False
        if alone:
            problem = (f"a Horovod script launched without horovodrun: each of the {launched} ranks runs Horovod "
                       f"alone (hvd.size() is 1), training a model of its own with no all-reduce; launch it with "
                       f"`dprorun --backend horovod -np {launched} ...` (horovodrun) to train them together")
            warn(problem)
            if problem not in use.problems:
                use.problems.append(problem)
        return result

    return watched


def _timed_backward(backward, name: str, use: ScriptUse):
    """An autograd Function's backward (its collective) timed for `use.timed` as "<name> (backward)"."""
    @functools.wraps(backward)
    def timed(ctx, *grads):
        if use.timed is None:
            return backward(ctx, *grads)
        return _timed_call(use, f"{name} (backward)", backward, ctx, *grads)

    return timed


def _timed_call(use: ScriptUse, label: str, call, /, *args, **kwargs):
    """call(*args, **kwargs), its µs told to `use.timed` under `label` (a failing listener never reaches the call;
    positional-only: the call's own keywords, as hvd.allgather's name=, pass through)."""
    start = time.perf_counter()
    try:
        return call(*args, **kwargs)
    finally:
        _tell_timed(use, label, (time.perf_counter() - start) * 1e6)


# where each call the tracker of the script's gradient collectives may make asynchronous takes async_op positionally
# (all_reduce(tensor, op, group, async_op); reduce_scatter(output, input_list, op, group, async_op), ...)
ASYNC_OP_POSITION = {"all_reduce": 3, "reduce_scatter": 4, "reduce_scatter_tensor": 4, "reduce_scatter_single": 4,
                     "all_gather": 3, "all_gather_into_tensor": 3, "all_gather_single": 3}


def call_tensors(args: tuple, kwargs: dict, position: int, keyword: str) -> list:
    """The tensors a torch.distributed call was given at `position` or as `keyword` (a list's, or the one), [] for
    anything without a size: what the hook-bytes meter and the tracker of the script's own collectives read."""
    value = args[position] if len(args) > position else kwargs.get(keyword)
    return [t for t in (value if isinstance(value, (list, tuple)) else [value]) if hasattr(t, "numel")]


def _asks_for_work(use: ScriptUse, name: str, args: tuple, kwargs: dict) -> bool:
    """A synchronous call the tracker of the script's gradient all-reduces wants a Work of (`ScriptUse.wants_work`);
    never one given async_op, positionally or by name."""
    if use.wants_work is None or name not in ASYNC_OP_POSITION or kwargs.get("async_op") or \
            len(args) > ASYNC_OP_POSITION[name]:
        return False
    try:
        return bool(use.wants_work(name, args, kwargs))
    except Exception:
        return False


def _tell_timed(use: ScriptUse, label: str, us: float) -> None:
    """`use.timed(label, us)`; a failing listener never reaches the script's call."""
    try:
        use.timed(label, us)
    except Exception:
        pass


def _counted_collective(module, name: str, use: ScriptUse, counted: bool = True):
    """`module.name` counted (`counted`: as a way of sharing gradients) and told to the listeners before it runs,
    and timed for `use.timed` where the caller is no module of dprorun's (its calibration, probes and gather)."""
    collective = getattr(module, name)
    compiler = sys.modules.get("torch.compiler")

    @functools.wraps(collective)
    def watched(*args, **kwargs):
        _refused_alone(use, f"{module.__name__}.{name}")
        if compiler is not None and compiler.is_compiling():  # traced code: left as torch's own call
            return collective(*args, **kwargs)
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if counted and not caller.startswith(FSDP_PACKAGE):  # FSDP's own calls (torch 2.13's _single names)
            use.collectives[name] = use.collectives.get(name, 0) + 1
        for listener in use.listeners:
            try:
                listener(name, args, kwargs)
            except Exception:  # a listener never reaches the script's collective
                pass
        if use.timed is None or caller.startswith("dprorun."):
            return collective(*args, **kwargs)
        label = f"{module.__name__}.{name}"
        waited = _asks_for_work(use, name, args, kwargs)
        start = time.perf_counter()
        try:
            result = collective(*args, **dict(kwargs, async_op=True)) if waited else collective(*args, **kwargs)
        except BaseException:
            _tell_timed(use, label, (time.perf_counter() - start) * 1e6)
            raise
        us = (time.perf_counter() - start) * 1e6
        bucket = False
        if use.returned is not None:
            try:
                bucket = use.returned(name, args, kwargs, result, us, waited)
            except Exception:  # a listener never reaches the script's collective
                bucket = False
        if not bucket:
            _tell_timed(use, label, us)
        if waited and result is not None:
            result.wait()
            if use.work_waited is not None:
                use.work_waited()
            return None
        return result

    return watched


def _warn_torchrun_script_under_horovodrun(method, kwargs: dict) -> None:
    """A torchrun script (init_process_group from the environment: RANK, WORLD_SIZE, MASTER_ADDR) launched with
    --backend horovod, where horovodrun gives its ranks HOROVOD_RANK and no RANK: torch raises "environment variable
    RANK expected"; said first, with the launch that fits."""
    if "HOROVOD_RANK" not in os.environ or "RANK" in os.environ or "rank" in kwargs or "store" in kwargs:
        return
    if method is None or (isinstance(method, str) and method.startswith("env://")):
        warn("this script starts torch.distributed from the environment (init_process_group: RANK, WORLD_SIZE, "
             "MASTER_ADDR, as torchrun sets them), but it runs under horovodrun (--backend horovod), which sets "
             "HOROVOD_RANK instead: run it as under torchrun, `dprorun -np N python <script>` (without --backend "
             "horovod)")


def _warn_own_rendezvous(method) -> None:
    if isinstance(method, str) and method.startswith("tcp://") and \
            os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        address = method[len("tcp://"):].split("?", 1)[0]
        served = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        if address != served:
            warn(f"init_process_group(init_method={method!r}): under dprorun, as under torchrun, the ranks "
                 f"rendezvous through the launcher's store ({served}, TORCHELASTIC_USE_AGENT_STORE=True), so "
                 f"this waits for a store at {address} that nobody serves until its timeout; use "
                 "init_method='env://' (or leave it out) and let the launcher set MASTER_ADDR, MASTER_PORT, RANK "
                 "and WORLD_SIZE")


MODEL_SPLITS = {  # module -> (callable or class it builds a split with, what it is called in the message)
    "torch.distributed.tensor.parallel": ("parallelize_module",
                                          "tensor-parallel plan(s) (torch.distributed.tensor.parallel)"),
    "torch.distributed.pipelining": ("PipelineStage", "pipeline stage(s) (torch.distributed.pipelining)"),
}


def watch_model_splits(use: ScriptUse, module_name: str) -> None:
    """A model split across ranks, built through `module_name` (MODEL_SPLITS): counted, to be named when nothing
    could be profiled (the job runs as under torchrun)."""
    name, what = MODEL_SPLITS[module_name]

    def count() -> None:
        use.model_splits[what] = use.model_splits.get(what, 0) + 1

    _count_builds(sys.modules[module_name], name, count)


COUNTED = "_dprorun_counted"  # on a wrapper of _count_builds


def _count_builds(module, name: str, count: Callable[[], None]) -> None:
    """`module.name` counted at each build: a class at each __init__, a function at each call (functools.wraps keeps
    what callers read, as fully_shard.state); left alone where it is missing or already counted (marked by
    COUNTED: fully_shard comes wrapped by torch already, so __wrapped__ cannot tell)."""
    original = getattr(module, name, None)
    if isinstance(original, type):
        original_init = original.__init__
        if getattr(original_init, COUNTED, False):
            return

        @functools.wraps(original_init)
        def init(self, *args, **kwargs):
            count()
            return original_init(self, *args, **kwargs)

        setattr(init, COUNTED, True)
        original.__init__ = init
    elif callable(original) and not getattr(original, COUNTED, False):
        @functools.wraps(original)
        def counted(*args, **kwargs):
            count()
            return original(*args, **kwargs)

        setattr(counted, COUNTED, True)
        setattr(module, name, counted)


def watch_fsdp(use: ScriptUse, module_name: str) -> None:
    """FSDP wrappers the script builds (FullyShardedDataParallel, fully_shard) through `module_name`
    (torch.distributed.fsdp, or the composable API's older home): counted. The package is imported by torch itself
    too (an optimizer's step imports parts of it), so its presence alone says nothing."""
    def count() -> None:
        use.fsdp_wrappers += 1

    for name in ("FullyShardedDataParallel", "fully_shard"):
        _count_builds(sys.modules[module_name], name, count)
