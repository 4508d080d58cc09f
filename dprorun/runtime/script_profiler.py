"""The training script's own profiler beside dprorun's. A process runs one profiler at a time: a second
torch.profiler session takes the first one's events (the script's got none) and a DDP rank stopping both died of
SIGSEGV; TensorFlow refuses a second (AlreadyExistsError: dprorun's window was disabled, or the script raised);
mx.profiler has one configuration (the script's set_config sent dprorun's events to the script's file and
dprorun's dump failed). The script's profiler comes first:
  - on when dprorun's is due (the window's first iteration): dprorun's detailed tier (its profiler, per-parameter
    hooks, module scopes) waits (ProfilerBusy) and starts at the first iteration after the script's stopped that
    leaves --kineto-iters of them in the window; where none does, the window has no op-level profile (said) and
    still records its phases, buckets and pushes;
  - started while dprorun's records: dprorun's stops first and keeps the iterations it profiled in full (none: it
    waits as above);
  - every iteration during which the script's profiler was on is listed (`script_profiler_iterations` in
    events.json and clean.json): the readers leave them out of the window's and the clean iterations' statistics
    where others remain (they ran under that profiler, slower).
The calls are watched where every front end passes: torch.autograd.profiler.profile (torch.profiler.profile,
Lightning's and the Trainers' profilers drive it), tf.profiler.experimental.start/stop (Keras's TensorBoard
callback, tf.profiler.experimental.Profile), mx.profiler.set_state/set_config. dprorun's own profiler calls pass
through `ScriptProfilerState.own_calls()`.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

if TYPE_CHECKING:
    from dprorun.runtime.session import RankSession


class ProfilerBusy(Exception):
    """dprorun's profiler was due while the script's own recorded: it is left unstarted (the message says why)."""


@dataclass
class ScriptProfilerState:
    """What the watched calls have seen: the script's profilers now on (by id), and whether a call is dprorun's."""

    open: set[int] = field(default_factory=set)
    own_call: bool = False
    refused_ours: bool = False  # the script's was on whenever dprorun's could have run in the window
    name: str = ""  # the script's profiler, as the messages name it

    @property
    def on(self) -> bool:
        return bool(self.open)

    @contextlib.contextmanager
    def own_calls(self) -> Iterator[None]:
        """dprorun's own profiler calls: not the script's."""
        previous, self.own_call = self.own_call, True
        try:
            yield
        finally:
            self.own_call = previous


def busy_message(name: str) -> str:
    return (f"the script's own {name} was on whenever dprorun's profiler could have run in the window: a process "
            "runs one profiler at a time, so dprorun left the script's alone and this window has no op-level profile "
            "(its phases and communication are recorded); run dprorun with a --warmup that places the window "
            "outside the script's profiled steps for one")


def _wrap(session: "RankSession", owner: Any, attribute: str, before: Callable[..., Any],
          failed: Optional[Callable[..., None]] = None) -> None:
    """owner.attribute(*args) calls before(*args) first, then the original; where the original raises (a start the
    profiler refused: a bad log folder, another profiler on) after before marked the script's profiler on (it
    returned True), failed(*args) takes that back, and the script gets the error as it would. A failure in before
    or failed disables profiling and never reaches the script."""
    original = getattr(owner, attribute)
    if getattr(original, "_dprorun_wrapped", False):
        return

    def watched(step: Callable[..., Any], *args, **kwargs) -> Any:
        try:
            return step(*args, **kwargs)
        except Exception as exc:
            session.disable(f"watching the script's profiler failed: {type(exc).__name__}: {exc}")
            return None

    @functools.wraps(original)
    def wrapped(*args, **kwargs):
        marked = watched(before, *args, **kwargs)
        try:
            return original(*args, **kwargs)
        except BaseException:
            if marked is True and failed is not None:
                watched(failed, *args, **kwargs)
            raise

    wrapped._dprorun_wrapped = True
    setattr(owner, attribute, wrapped)


def watch_torch(session: "RankSession") -> None:
    """torch.autograd.profiler.profile: _prepare_trace / _start_trace (the script's profiler on, kineto prepared
    or recording) and __exit__ (off)."""
    from torch.autograd.profiler import profile

    state = session.script_profiler
    state.name = "torch.profiler"

    def on(prof, *args, **kwargs) -> bool:
        if not state.own_call and id(prof) not in state.open:
            state.open.add(id(prof))
            session.script_profiler_started()
            return True
        return False

    def off(prof, *args, **kwargs):
        if not state.own_call and id(prof) in state.open:
            state.open.discard(id(prof))
            if not state.open:
                session.script_profiler_stopped()

    _wrap(session, profile, "_prepare_trace", on, off)
    _wrap(session, profile, "_start_trace", on, off)
    _wrap(session, profile, "__exit__", off)


def torch_busy(state: ScriptProfilerState) -> bool:
    """The script's torch.profiler is prepared or recording (or another profiler of torch's is enabled)."""
    import torch

    enabled = getattr(getattr(torch._C, "_autograd", None), "_profiler_enabled", None)
    return state.on or bool(enabled is not None and enabled())


def watch_tf(session: "RankSession") -> None:
    """tf.profiler.experimental.start/stop, in the API modules and in profiler_v2 (its Profile context calls it). The
    API has a module object per path: tf_keras's TensorBoard callback calls tf.compat.v2's (it imports
    tensorflow.compat.v2 as tf), which is not tf.profiler.experimental: its profile went unseen."""
    import tensorflow as tf
    from tensorflow.python.profiler import profiler_v2

    state = session.script_profiler
    state.name = "TensorFlow profiler"

    def on(*args, **kwargs) -> bool:
        if not state.own_call and not state.on:
            state.open.add(0)
            session.script_profiler_started()
            return True
        return False

    def off(*args, **kwargs):
        if not state.own_call and state.on:
            state.open.clear()
            session.script_profiler_stopped()

    for owner in (profiler_v2, *_tf_profiler_api_modules(tf)):
        _wrap(session, owner, "start", on, off)
        _wrap(session, owner, "stop", off)


def _tf_profiler_api_modules(tf: Any) -> list:
    """tf.profiler.experimental and its copies under tf.compat (one module object each)."""
    found = []
    for path in ("profiler.experimental", "compat.v2.profiler.experimental", "compat.v1.profiler.experimental"):
        owner = tf
        for name in path.split("."):
            owner = getattr(owner, name, None)
        if owner is not None and hasattr(owner, "start") and all(owner is not f for f in found):
            found.append(owner)
    return found


def tf_busy(state: ScriptProfilerState) -> bool:
    from tensorflow.python.profiler import profiler_v2

    return state.on or getattr(profiler_v2, "_profiler", None) is not None


def watch_mxnet(session: "RankSession") -> None:
    """mx.profiler.set_state("run" / "stop") by the script; its set_config while dprorun's records stops dprorun's
    first (the configuration, output file included, is the process's one)."""
    import mxnet as mx

    state = session.script_profiler
    state.name = "mx.profiler"

    def set_state(*args, **kwargs):  # mx.profiler.set_state(state="stop", profile_process="worker")
        name = args[0] if args else kwargs.get("state", "stop")
        process = args[1] if len(args) > 1 else kwargs.get("profile_process", "worker")
        if state.own_call or process != "worker":
            return False
        if name == "run" and not state.on:
            state.open.add(0)
            session.script_profiler_started()
            return True
        if name == "stop" and state.on:
            state.open.clear()
            session.script_profiler_stopped()
        return False

    def set_config(*args, **kwargs):
        if not state.own_call:
            session.script_profiler_configured()

    def start_failed(*args, **kwargs):  # set_state("run") raised: the script's profiler is not on
        state.open.clear()
        session.script_profiler_stopped()

    _wrap(session, mx.profiler, "set_state", set_state, start_failed)
    _wrap(session, mx.profiler, "set_config", set_config)
