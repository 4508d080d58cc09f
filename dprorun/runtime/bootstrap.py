"""Entry point of the hooks inside a rank: called from hooks/sitecustomize.py at interpreter start-up.

Installs, only in a rank process launched by dprorun (DPRO_ENABLED=1 and RANK, or HOROVOD_RANK under
horovodrun, set; not in its subprocesses): an import hook that patches DistributedDataParallel when
torch.nn.parallel.distributed is imported and horovod.torch's DistributedOptimizer when horovod.torch.optimizer
is (torch is not imported here: start-up stays fast; processes the script spawns itself are counted), the sampler
thread, an excepthook that writes torchelastic's per-rank error file, and exit/SIGTERM handlers that keep what was
recorded.
"""
from __future__ import annotations

import atexit
import functools
import importlib.abc
import importlib.machinery
import os
import signal
import sys
import threading
import time
from typing import Callable, Optional

from dprorun.layout import STOPPED_BY_SIGTERM
from dprorun.runtime.raised import leave_an_mxnet_worker_that_raised, note_script_raised, note_uncaught_at_exit, \
    watch_sys_exit

_SESSION = None


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Runs a callback right after a watched module has executed."""

    def __init__(self, callbacks: dict[str, Callable[[], None]]):
        self.callbacks = callbacks

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.callbacks:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        loader = spec.loader
        callback = self.callbacks[fullname]
        original_exec = loader.exec_module

        def exec_module(module):
            original_exec(module)
            callback()

        loader.exec_module = exec_module
        return spec


def session():
    """The rank's session, or None outside a dprorun rank."""
    return _SESSION


def _note_a_script_run_in_a_subprocess(owner: str, environ) -> None:
    """A new interpreter started by the rank's process to run a script (a wrapper's `subprocess.run([sys.executable,
    "train.py"])`, accelerate's launcher), not a multiprocessing child: its command line kept in the rank's folder, so
    that a rank that trained nothing itself can say where its training went (runtime/watch.nothing_to_profile)."""
    argv = list(getattr(sys, "orig_argv", []) or [])
    if str(os.getppid()) != owner or len(argv) < 2 or argv[1] == "-c" or "multiprocessing" in " ".join(argv) \
            or not environ.get("DPRO_RUN_DIR"):
        return
    script = argv[2] if argv[1] == "-m" and len(argv) > 2 else os.path.abspath(argv[1])
    if script.startswith(("torch.", "concurrent.", sys.prefix, sys.base_prefix)):
        return  # a library's helper process (torch.compile's workers), not a training script
    from dprorun.layout import SUBPROCESS_SCRIPTS_FILE, rank_dir

    try:
        folder = rank_dir(environ["DPRO_RUN_DIR"], int(environ.get("RANK", environ.get("HOROVOD_RANK", "0"))))
        os.makedirs(folder, mode=0o700, exist_ok=True)
        with open(os.path.join(folder, SUBPROCESS_SCRIPTS_FILE), "a") as f:
            f.write(" ".join(argv[1:]) + "\n")
    except (OSError, ValueError):
        pass


def _watch_a_child_of_a_one_process_launch(environ) -> None:
    """A child interpreter in a DDP job dprorun launched as one process (multiprocessing's spawn or forkserver, or a
    script the launched one ran with subprocess, as a launcher of its own does): it may be a rank the script starts
    itself (runtime/spawned.py)."""
    from dprorun.runtime.spawned import ONE_PROCESS_LAUNCH, child_patches

    if ONE_PROCESS_LAUNCH not in environ:
        return
    pending = child_patches(become_rank)
    for name in [name for name in pending if name in sys.modules]:
        pending.pop(name)()
    if pending:
        sys.meta_path.insert(0, _PatchOnImport(pending))


def install(environ=os.environ) -> Optional[object]:
    global _SESSION
    horovod = "RANK" not in environ and "HOROVOD_RANK" in environ  # a horovodrun rank
    mxnet_role = environ.get("DMLC_ROLE", "") if environ.get("DPRO_BACKEND") == "mxnet" else ""
    if mxnet_role in ("scheduler", "server"):  # no session: a server's updates are timed, the scheduler is left be
        return _install_mxnet_server(environ) if mxnet_role == "server" else None
    if _SESSION is not None or environ.get("DPRO_ENABLED") != "1" or (
            "RANK" not in environ and not horovod and not mxnet_role):
        return _SESSION
    owner = environ.get("DPRO_HOOKED_PID")
    if owner and owner != str(os.getpid()):
        _note_a_script_run_in_a_subprocess(owner, environ)
        # not profiled (a data loader's worker, ...), but it may train on gloo itself (torch.multiprocessing.spawn's
        # processes): the same wait at its exit as a rank's (runtime/gloo_exit.py)
        from dprorun.runtime.gloo_exit import wait_for_idle_gloo_workers

        atexit.register(wait_for_idle_gloo_workers)
        _watch_a_child_of_a_one_process_launch(environ)
        return None
    os.environ["DPRO_HOOKED_PID"] = str(os.getpid())

    from dprorun.config import ProfileConfig
    from dprorun.runtime.session import RankSession, warn

    try:
        cfg = ProfileConfig.from_env(environ)
    except ValueError as exc:
        warn(f"bad profiling configuration, hooks not installed: {exc}")
        return None
    prefix = "HOROVOD_" if horovod else ""
    rank = int(environ.get(prefix + "RANK", environ.get("DPRO_MX_INDEX", "0")))
    local_rank = int(environ.get(prefix + "LOCAL_RANK", "0"))
    world = int(environ.get(prefix + "SIZE" if horovod else "WORLD_SIZE", environ.get("DMLC_NUM_WORKER", "1")))
    if not (horovod or mxnet_role) and int(environ.get("TORCHELASTIC_RESTART_COUNT") or 0) > 0:
        _set_aside_the_attempt_before(cfg.run_dir, rank, local_rank, environ)
    sess = RankSession(cfg, rank, local_rank, world)
    _SESSION = sess
    if not (horovod or mxnet_role):
        from dprorun.runtime.spawned import mark_a_one_process_launch

        mark_a_one_process_launch(world, environ.get("DPRO_BACKEND"), become_rank)

    pending = {}
    for name, callback in _framework_patches(sess, environ.get("DPRO_BACKEND"), mxnet_role).items():
        if name in sys.modules:
            callback()
        else:
            pending[name] = callback
    if pending:
        sys.meta_path.insert(0, _PatchOnImport(pending))

    _start_sampler(sess)
    atexit.register(_at_interpreter_exit, sess)
    _keep_records_at_os_exit(sess)
    _install_excepthook(sess)
    _install_sigterm(sess)
    _guard_output_files(sess)
    return sess


def _set_aside_the_attempt_before(run_dir: str, rank: int, local_rank: int, environ) -> None:
    """torch elastic restarted the ranks (--max-restarts): the attempt before's files out of the rank folders (the
    launcher names where they went)."""
    from dprorun.layout import set_aside_a_failed_attempt
    from dprorun.runtime.log import warn

    attempt = int(environ["TORCHELASTIC_RESTART_COUNT"])
    try:
        set_aside_a_failed_attempt(run_dir, attempt, rank, local_rank, int(environ.get("LOCAL_WORLD_SIZE") or 1))
    except OSError as exc:
        warn(f"restart {attempt}: the attempt before's files could not be set aside ({exc}); this attempt's files "
             "will replace them one by one")


def _start_sampler(sess) -> None:
    try:
        from dprorun.runtime.samplers import Sampler

        sess.sampler = Sampler(sess.cfg.sample_interval_s, sess.local_rank, sess.now_us,
                               fast=lambda: sess.phase == "active")
        sess.sampler.start()
    except Exception as exc:
        sess.records.warnings.append(f"sampler not started: {exc}")


def profiled_entry(fn: Callable, nprocs: int) -> Callable:
    """The function torch.multiprocessing.spawn runs in each process in place of the script's fn, in a DDP job
    dprorun launched as one process (runtime/watch.watch_spawns): picklable as the script's own is (a partial of two
    module-level functions)."""
    return functools.partial(run_spawned_rank, fn, int(nprocs))


def run_spawned_rank(fn: Callable, nprocs: int, index: int, *args) -> object:
    """In a process mp.spawn started: rank `index` of `nprocs` (until init_process_group says otherwise,
    runtime/spawned.py), then the script's fn(index, *args)."""
    try:
        from dprorun.runtime.spawned import watch_torch_distributed

        watch_torch_distributed(become_rank)
        become_rank(index, nprocs, index, nprocs)
    except Exception as exc:  # never in the way of the script's own training
        from dprorun.runtime.log import warn

        warn(f"spawned process {index} is not profiled: {type(exc).__name__}: {exc}", index)
    return fn(index, *args)


def become_rank(rank: int, world_size: int, local_rank: Optional[int] = None,
                local_world: Optional[int] = None) -> None:
    """This process, started by the script, is rank `rank` of `world_size` (on this host: `local_rank` of
    `local_world`; not given, as given at the spawn, else the rank and world size themselves): its rank variables,
    and its session (installed, or the one it holds made this rank's while nothing is recorded)."""
    current = _SESSION
    spawned = current is not None and current.pid == os.getpid() and current.spawned_by_script
    if spawned and (current.rank, current.world_size) == (rank, world_size):
        return
    if local_rank is None:
        local_rank = current.local_rank if spawned else rank
    if local_world is None:
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE") or world_size) if spawned else world_size
    from dprorun.runtime.spawned import started_by_another_agent

    if not started_by_another_agent():  # a worker of an elastic agent the script ran has that agent's
        # the launcher's rank variables, inherited, made this rank's (a framework that read them in the launched
        # process, as Lightning's ddp_spawn under a torchrun-like environment does, reads them again in each spawned
        # one: before, every process was rank 0 of 1)
        os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(local_rank), "ROLE_RANK": str(rank),
                           "WORLD_SIZE": str(world_size), "ROLE_WORLD_SIZE": str(world_size),
                           "LOCAL_WORLD_SIZE": str(local_world)})
        os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)  # decided at the store (runtime/spawned.py)
    environ = dict(os.environ)
    environ.pop("DPRO_HOOKED_PID", None)
    session = install_in_spawned_rank(environ)
    if session is not None:
        session.spawned_by_script = True


def install_in_spawned_rank(environ) -> Optional[object]:
    """A process the script spawned becomes a rank (runtime/spawned.py; `environ` names its rank). A fresh
    interpreter (start methods spawn and forkserver) installs as a launched rank does. A forked one holds its parent's
    session, to which the patches the parent applied are bound: that object is made this rank's (its records and
    clock anew; the exit handlers the parent registered run for it now), provided the parent had trained nothing; so
    is a session of this process that recorded nothing yet, given another rank at init_process_group."""
    current = _SESSION
    if current is None:
        return install(environ)
    if current.trackers or current.iteration >= 0:
        return None  # forked from a rank that trained (its records are the parent's), or training already
    from dprorun.config import ProfileConfig

    if current.pid == os.getpid() and current.sampler is not None:
        current.sampler.stop()
    # the watchers applied hold these objects (runtime/watch.py, runtime/script_profiler.py): kept, emptied
    use, profiler_state = current.script_use, current.script_profiler
    type(current).__init__(current, ProfileConfig.from_env(environ), int(environ["RANK"]),
                           int(environ["LOCAL_RANK"]), int(environ["WORLD_SIZE"]))
    for kept, fresh in ((use, current.script_use), (profiler_state, current.script_profiler)):
        for name, value in fresh.__dict__.items():  # the counts emptied; the trackers' callbacks kept
            old = kept.__dict__.get(name)
            if not (callable(old) or (isinstance(old, list) and old and all(callable(item) for item in old))):
                kept.__dict__[name] = value
    current.script_use, current.script_profiler = use, profiler_state
    os.environ["DPRO_HOOKED_PID"] = str(os.getpid())
    _start_sampler(current)
    return current


def _framework_patches(sess, backend: Optional[str], mxnet_role: str) -> dict[str, Callable[[], None]]:
    """Module name -> the patch to apply once it is imported: DDP, horovod.torch and horovod.tensorflow (and
    torch.multiprocessing.spawn, counted) in Horovod/torch jobs, tf.function (and Keras 3's fit) in TensorFlow
    workers, gluon's Trainer in MXNet workers. Each patch runs guarded."""
    def patch_ddp():
        from dprorun.runtime.ddp import patch_ddp_class

        sess.guard("patching DistributedDataParallel", patch_ddp_class, sess)

    def patch_replicate():
        from dprorun.runtime.ddp import patch_replicate

        sess.guard("patching replicate()", patch_replicate, sess)

    def patch_hvd():
        from dprorun.runtime.horovod import patch_horovod

        sess.guard("patching horovod.torch", patch_horovod, sess)

    def patch_hvd_tf():
        from dprorun.runtime.horovod_tf import patch_horovod_tensorflow

        sess.guard("patching horovod.tensorflow", patch_horovod_tensorflow, sess)

    def patch_tf():
        from dprorun.runtime.tf import patch_tensorflow

        sess.guard("patching TensorFlow", patch_tensorflow, sess)

    def patch_keras3():
        from dprorun.runtime.tf import patch_keras3_fit

        sess.guard("patching Keras 3's fit", patch_keras3_fit, sess)

    def patch_mxnet():
        from dprorun.runtime.mxnet import patch_mxnet_worker

        sess.guard("patching MXNet", patch_mxnet_worker, sess)

    if backend == "tf":  # TensorFlow workers: steps found through tf.function calls (torch.distributed: named)
        return {"tensorflow": patch_tf, "keras.src.backend.tensorflow.trainer": patch_keras3,
                "torch.distributed": _script_watches(sess)["torch.distributed"]}
    if mxnet_role:  # MXNet workers: iterations are Trainer.step calls (patched once gluon's trainer exists)
        sess.framework = "mxnet"
        return {"mxnet.gluon.trainer": patch_mxnet}
    return {"torch.nn.parallel.distributed": patch_ddp, "torch.distributed._composable.replicate": patch_replicate,
            "horovod.torch.optimizer": patch_hvd,
            "horovod.tensorflow": patch_hvd_tf,
            **_script_watches(sess)}


def _script_watches(sess) -> dict[str, Callable[[], None]]:
    """torch.distributed use outside the supported wrappers, counted in sess.script_use (runtime/watch.py)."""
    from dprorun.runtime import watch
    from dprorun.runtime.script_profiler import watch_torch
    from dprorun.runtime.spawned import LIGHTNING_ENVIRONMENTS, lightning_starts_its_ranks

    use = sess.script_use
    launched_world = sess.world_size
    return {**{name: functools.partial(sess.guard, "letting Lightning start its ranks", lightning_starts_its_ranks,
                                       name, become_rank) for name in LIGHTNING_ENVIRONMENTS},
            "torch.multiprocessing.spawn": lambda: sess.guard("watching torch.multiprocessing.spawn",
                                                              watch.watch_spawns, use, launched_world,
                                                              profiled_entry),
            "torch.distributed": lambda: _watch_torch_distributed(sess),
            "torch.autograd": lambda: _watch_gradient_collectives(sess),
            "torch.autograd.profiler": lambda: sess.guard("watching the script's profiler", watch_torch, sess),
            "horovod.torch": lambda: sess.guard("watching horovod.torch", watch.watch_horovod_torch, use),
            watch.FUNCTIONAL_MODULE: lambda: sess.guard("watching functional collectives",
                                                        watch.watch_functional_collectives, use),
            **{name: functools.partial(sess.guard, "watching FSDP", watch.watch_fsdp, use, name)
               for name in ("torch.distributed.fsdp", "torch.distributed._composable.fsdp")},
            **{name: functools.partial(sess.guard, "watching model splits", watch.watch_model_splits, use, name)
               for name in watch.MODEL_SPLITS}}


def _watch_torch_distributed(sess) -> None:
    from dprorun.runtime import watch

    sess.guard("watching torch.distributed", watch.watch_torch_distributed, sess.script_use)
    _watch_gradient_collectives(sess)


def _watch_gradient_collectives(sess) -> None:
    """Gradients the script all-reduces itself, profiled where no wrapper does (runtime/collectives.py): once both
    torch.distributed and torch.autograd are imported (torch imports the first one first)."""
    if "torch.distributed" in sys.modules and "torch.autograd" in sys.modules:
        from dprorun.runtime.collectives import watch_gradient_collectives

        sess.guard("watching the script's own gradient all-reduces", watch_gradient_collectives, sess)


def _at_interpreter_exit(sess) -> None:
    """The rank's records kept, then, last before the interpreter finalizes, gloo's worker threads left to drop
    the work they ran (runtime/gloo_exit.py: a late one aborted ranks whose work was done)."""
    try:
        sess.at_exit()
    finally:
        from dprorun.runtime.gloo_exit import wait_for_idle_gloo_workers

        wait_for_idle_gloo_workers()


def _keep_records_at_os_exit(sess) -> None:
    """os._exit skips the exit handlers: a script that ends so (some do, to avoid hanging threads at shutdown) lost
    the window's records when it ended inside it, and was told it built no supported wrapper. The rank's records are
    written first (at_exit; not in a process forked from the rank, as at a normal exit; only from the main thread: a
    watchdog thread's os._exit may come while the main thread holds the session's lock or runs the profiler)."""
    import threading

    real_exit = os._exit

    @functools.wraps(real_exit)
    def exit_keeping_records(code):
        if os.getpid() == sess.pid and threading.current_thread() is threading.main_thread():
            try:
                sess.at_exit()
            except BaseException:  # the exit goes ahead whatever happened to the records
                pass
        real_exit(code)

    os._exit = exit_keeping_records


def _install_mxnet_server(environ) -> Optional[object]:
    """A parameter server: its updates timed (runtime/mxnet.py). MXNet runs the server inside `import mxnet`, so the
    patch goes in when mxnet.kvstore.kvstore has executed, before kvstore_server starts the loop."""
    if environ.get("DPRO_ENABLED") != "1":
        return None
    from dprorun.runtime.mxnet import install_server, patch_mxnet_server

    recorder = install_server(environ)
    if recorder is not None:
        sys.meta_path.insert(0, _PatchOnImport({"mxnet.kvstore.kvstore": lambda: patch_mxnet_server(recorder)}))
    return recorder


class _FullDiskGuard:
    """sys.stdout / sys.stderr of a rank whose output dprorun tees into the run directory: when that disk is
    full, the job's own prints must not kill it (under plain torchrun they would go to a console). On ENOSPC the
    file descriptor is pointed at /dev/null, so the pending and later output is dropped, once, with a warning
    recorded in the trace."""

    def __init__(self, stream, session, fd: int):
        self._stream = stream
        self._session = session
        self._fd = fd

    def _drop(self, exc: OSError) -> None:
        import errno

        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise exc
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, self._fd)
        os.close(devnull)
        self._session.records.warnings.append(f"the disk holding this rank's log file is full: its output (fd "
                                              f"{self._fd}) is dropped from here on")

    def write(self, text):
        try:
            return self._stream.write(text)
        except OSError as exc:
            self._drop(exc)
            return self._stream.write(text)

    def flush(self):
        try:
            return self._stream.flush()
        except OSError as exc:
            self._drop(exc)
            return self._stream.flush()

    def __getattr__(self, name):
        return getattr(self._stream, name)


def _guard_output_files(sess) -> None:
    import stat

    for name, fd in (("stdout", 1), ("stderr", 2)):
        stream = getattr(sys, name)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                continue  # a console or a pipe: nothing on our disk
        except OSError:
            continue
        setattr(sys, name, _FullDiskGuard(stream, sess, fd))


def _install_excepthook(sess) -> None:
    """The rank's uncaught exception noted (runtime/raised.py) before the previous hook prints it; a script that
    puts a hook of its own in place later (rich.traceback.install(), a logger's) is still seen, at exit."""
    previous = sys.excepthook

    def excepthook(exc_type, exc, tb):
        if os.getpid() != sess.pid:  # a process forked from the rank: the rank's error file is not its own
            previous(exc_type, exc, tb)
            return
        note_script_raised(sess, exc, tb)
        previous(exc_type, exc, tb)
        if sess.framework == "mxnet":
            leave_an_mxnet_worker_that_raised(sess)

    sys.excepthook = excepthook
    watch_sys_exit(sess)
    atexit.register(note_uncaught_at_exit, sess)  # runs before _at_interpreter_exit (registered earlier)


def _install_sigterm(sess) -> None:
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return  # the script (or a library) handles SIGTERM itself

    stopping = threading.Lock()  # taken by whichever keeps the records: this handler or the watcher below

    def on_sigterm(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if not stopping.acquire(blocking=False):
            stopping.acquire()  # the watcher keeps them and ends the process: no training on meanwhile
            return
        try:
            if os.getpid() == sess.pid:  # not in a process forked from the rank (a pool's worker terminated)
                sess.records.warnings.append(STOPPED_BY_SIGTERM)
                sess.at_exit()
        finally:
            os.kill(os.getpid(), signal.SIGTERM)

    try:
        signal.signal(signal.SIGTERM, on_sigterm)
    except ValueError:
        return  # not the main thread
    os.register_at_fork(after_in_child=lambda: _sigterm_default_in_child(on_sigterm))
    if sess.framework == "mxnet":
        _sigterm_watcher(sess)
    else:
        _sigterm_while_waiting_in_cxx(sess, stopping, on_sigterm)


def _sigterm_while_waiting_in_cxx(sess, stopping: threading.Lock, handler: Callable) -> None:
    """A rank waiting in C++ for a peer that is gone (init_process_group's store; the window's gather making its
    group while the peer failed in the window's last step) does not return to Python, so the SIGTERM handler above
    never runs, and torch elastic's agent SIGKILLed it 30 s later, its records lost (torchrun's rank, with SIGTERM's
    default, leaves at once). A thread that the signal's wake-up byte reaches steps in when the handler has not
    started a second later: it keeps the records (none before the first step) and ends the process. Not while the
    profiler records (its stop belongs to the thread that started it: the rank is left to the agent then), nor
    where the script has put a SIGTERM handler of its own in place of the hooks' (a preempted job's checkpoint)."""
    read_end = _signal_wakeup_pipe()
    if read_end is None:
        return

    def watch() -> None:
        while True:
            data = os.read(read_end, 64)
            if not data:
                return
            if signal.SIGTERM not in data or os.getpid() != sess.pid:
                continue
            time.sleep(1.0)
            profiling = sess.phase == "active" or (sess.disabled and sess.profiler is not None)
            if profiling or signal.getsignal(signal.SIGTERM) is not handler or not stopping.acquire(blocking=False):
                continue
            try:
                if sess.iteration >= 0:
                    sess.records.warnings.append(STOPPED_BY_SIGTERM)
                    sess.at_exit()
            finally:
                os._exit(128 + signal.SIGTERM)

    threading.Thread(target=watch, name="dprorun-sigterm-in-cxx", daemon=True).start()
    os.register_at_fork(after_in_child=_wakeup_fd_off)


def _sigterm_default_in_child(handler) -> None:
    """In a process forked from the rank (a data loader's pool worker): SIGTERM back to its default. A Python
    handler runs only in the main thread, and a pool worker waits in a lock with no timeout while its other threads
    (MXNet's engine, a resource sharer) may take the signal: the pool's terminate at the loader's end then waited
    for it forever, and the job hung (1 launch in 7 of a Gluon job with a new DataLoader every 8 steps)."""
    try:
        if signal.getsignal(signal.SIGTERM) is handler:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
    except ValueError:
        pass


def _sigterm_watcher(sess) -> None:
    """An MXNet worker blocked in its kvstore (a peer gone) never returns to Python, so a Python SIGTERM handler
    would not run until the launcher's SIGKILL 30 s later: the signal's wake-up byte reaches a thread instead,
    which keeps the traces and leaves at once."""
    import threading
    import time

    read_end = _signal_wakeup_pipe()
    if read_end is None:
        return

    stopping = threading.Event()
    reading = threading.Lock()  # held from a wake-up byte's read to its SIGTERM being known: see the fork hook

    def watch() -> None:
        import select

        while True:
            select.select([read_end], [], [])
            with reading:
                data = os.read(read_end, 64)
                if signal.SIGTERM in data:
                    stopping.set()
            if not data:
                return
            if signal.SIGTERM in data:
                try:
                    sess.records.warnings.append(STOPPED_BY_SIGTERM)
                    sess.at_exit()
                finally:
                    os._exit(128 + signal.SIGTERM)

    def no_fork_while_stopping() -> None:
        """A fork in a stopping worker never happens: the thread that asked for it waits here (without the GIL)
        until the watcher ends the process. The launcher's SIGTERM reaches the worker's whole process group, so a
        DataLoader's pool loses its processes at that moment and its handler thread forks new ones; MXNet's
        prepare-fork handler stops the engine, which waits for every pending operation, and a pull from a peer
        that is gone never ends, while that thread holds the GIL: the watcher could not write the traces, and
        the worker was SIGKILLed 30 s later with its last records lost (1 failing job in 4 with such a loader).
        A SIGTERM whose wake-up byte the watcher has not read yet, or is reading (it waits for the GIL after its
        read), counts too: the fork waits for the watcher to know (still 3 SIGKILLs in 20 launches without this).
        So does one still pending in the kernel: the kernel hands a process's signal to one thread, the main one
        if it can, and a main thread in uninterruptible sleep (an fsync of the window's files) takes it, and
        writes the wake-up byte, only when its sleep ends, while the loader's threads, not chosen, run on and fork
        (2 SIGKILLs in 25 launches of the suite's job, 0 in 45 with this; gdb: the main thread in os.fsync or a
        kvstore wait, the pool's handler thread in MXNet's prepare-fork wait)."""
        import select

        if os.getpid() != sess.pid:
            return
        while True:
            with reading:  # the watcher between its read and knowing what it read holds this
                pending = bool(select.select([read_end], [], [], 0)[0]) or _sigterm_pending_in_kernel()
            if stopping.is_set():
                while True:
                    time.sleep(60)
            if not pending:
                return
            time.sleep(0.005)  # a byte not read yet: the watcher's turn (the GIL released here)

    threading.Thread(target=watch, name="dprorun-sigterm", daemon=True).start()
    os.register_at_fork(before=no_fork_while_stopping, after_in_child=_wakeup_fd_off)


def _signal_wakeup_pipe() -> Optional[int]:
    """A pipe Python writes each handled signal's number to as it arrives, whatever the main thread is doing (its
    wake-up fd): the read end, for a watcher thread; None where the fd cannot be set (not the main thread)."""
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    try:
        signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    except ValueError:
        os.close(read_end)
        os.close(write_end)
        return None
    return read_end


def _sigterm_pending_in_kernel() -> bool:
    """Is a SIGTERM sent to this process still waiting for a thread to take it (/proc/self/status, ShdPnd)?"""
    try:
        with open("/proc/self/status", "rb") as status:
            for line in status:
                if line.startswith(b"ShdPnd:"):
                    return bool(int(line.split()[1], 16) >> (signal.SIGTERM - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def _wakeup_fd_off() -> None:
    """In a process forked from a rank (a DataLoader's pool worker): the wake-up fd is the rank's pipe, where a
    SIGTERM to the child (the pool's terminate at the loader's end) would reach the rank's watcher thread and stop
    the rank."""
    try:
        signal.set_wakeup_fd(-1)
    except ValueError:
        pass
