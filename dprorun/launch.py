"""Process management: start every rank with the hooks injected, watch them, stop the group on failure.

Nothing here spawns or watches processes by hand: torch.distributed.elastic's launch API does that (the engine
behind torchrun): static rendezvous, per-rank log files tee'd to the console with a rank prefix, per-rank error
files, SIGINT/SIGTERM handling and group teardown. dprorun configures it and puts the hooks on PYTHONPATH.
`--launcher torchrun` hands the whole launch to the torchrun CLI in a child process instead.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import socket
import sys
import time
from typing import Optional, Sequence

from dprorun.config import ElasticAgentOptions, JobConfig
from dprorun.console_tail import output_redrawn_in_place
from dprorun.fsutil import atomic_write_json, free_mb, make_private_dir
from dprorun.layout import rank_folders
# the shared process helpers, importable from here as before
from dprorun.procs import LaunchResult, Watchdog, call_forwarding_signals, error_hint, error_line, error_message, \
    exit_abort_hint, failed_attempts, free_port, last_words, launcher_signal_handlers_restored, rank_environment, \
    signal_name, split_command


def write_manifest(job: JobConfig, status: str, extra: Optional[dict] = None) -> str:
    from dprorun import __version__

    path = os.path.join(job.output.run_dir, "manifest.json")
    previous = {}
    if os.path.exists(path):
        try:
            with open(path) as handle:
                previous = json.load(handle)
        except (OSError, ValueError):
            previous = {}
    manifest = dict(previous)
    manifest.update({
        "schema": "dprorun-run",
        "version": 1,
        "job_id": job.profile.job_id,
        "status": status,
        "command": job.command,
        "backend": job.launch.backend,
        "horovod_args": job.horovod.args,
        "strategy": job.strategy_file,
        "launcher": job.launch.launcher,
        "world_size": job.launch.world_size,
        "nnodes": job.launch.nnodes,
        "nproc_per_node": job.launch.nproc_per_node,
        "node_rank": job.launch.node_rank,
        "master_addr": job.launch.master_addr,
        "launch_host": job.profile.launch_host,
        "profiling_window": {"warmup": job.profile.warmup, "active": job.profile.active,
                             "clean": job.profile.clean, "kineto": job.profile.kineto,
                             "kineto_iters": job.profile.kineto_iters,
                             "record_shapes": job.profile.record_shapes,
                             "comm_detail": job.profile.comm_detail},
        "clock": {"source": "time.time_ns (epoch µs)",
                  "test_clock_skew_us": job.profile.clock_skew_us or None},
        "versions": _versions(__version__),
    })
    manifest.setdefault("started_at", time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    if extra:
        manifest.update(extra)
    atomic_write_json(path, manifest, indent=2)
    return path


def _versions(dprorun_version: str) -> dict:
    """dprorun's, Python's and torch's versions (torch's from its installed metadata: importing torch takes 2-3 s,
    which a TensorFlow, Horovod or MXNet job's launcher has no other reason to spend)."""
    from importlib.metadata import PackageNotFoundError, version

    out = {"dprorun": dprorun_version, "python": sys.version.split()[0]}
    try:
        out["torch"] = version("torch")
    except PackageNotFoundError:
        pass
    return out


def low_disk(job: JobConfig) -> Optional[str]:
    """Why the run directory's filesystem is too full to profile, or None."""
    free = free_mb(job.output.run_dir)
    if free < job.profile.min_free_mb:
        return (f"only {free:.0f} MB free on the run directory's filesystem ({job.output.run_dir}; DPRO_MIN_FREE_MB="
                f"{job.profile.min_free_mb:.0f}): profiling and per-rank log files are off, the job runs as under "
                "torchrun")
    return None


# TensorFlow's profiler stop can crash a worker (see relaunch_after_tf_stop_crash): the job is launched again with
# the profiler, twice at most, then once more without it. About 1 launch in 8 crashes (3 of 23 in session 27; the
# project's CI met two in a row in one job in session 56): three profiled launches leave a job without its op-level
# profile about 1 time in 500 instead of 1 in 60, at the price of one more early-ended launch when it crashes each time
TF_STOP_CRASH_LAUNCHES = 4


def launch(job: JobConfig) -> LaunchResult:
    """Launch the job; one that failed because a worker died inside TensorFlow's profiler stop is launched again
    (`relaunch_after_tf_stop_crash`)."""
    with launcher_signal_handlers_restored():
        result = _launch_once(job)
    relaunches, elapsed_s = [], result.elapsed_s
    while result.exit_code != 0 and job.profile.launch_attempt < TF_STOP_CRASH_LAUNCHES:
        why = relaunch_after_tf_stop_crash(job, result)
        if not why:
            break
        relaunches.append(why)
        with launcher_signal_handlers_restored():
            result = _launch_once(job)
        elapsed_s += result.elapsed_s
    result.relaunches, result.elapsed_s = relaunches + result.relaunches, elapsed_s
    return result


def tf_stop_crashes(job: JobConfig, result: LaunchResult) -> list[int]:
    """The ranks (whose folders are on this host) that died inside TensorFlow's profiler stop: their folder still
    holds the mark the hooks remove when the stop returns, and (where the engine reports how each rank ended)
    a signal killed them, not the launcher's SIGTERM/SIGKILL at teardown."""
    from dprorun.layout import TF_PROFILER_STOP_MARK, rank_dir

    crashed = []
    for rank in range(job.launch.world_size):
        if not os.path.exists(os.path.join(rank_dir(job.output.run_dir, rank), TF_PROFILER_STOP_MARK)):
            continue
        code = (result.failures.get(rank) or {}).get("exitcode")
        if code is None or (code < 0 and -code not in (signal.SIGTERM, signal.SIGKILL)):
            crashed.append(rank)
    return crashed


def relaunch_after_tf_stop_crash(job: JobConfig, result: LaunchResult) -> str:
    """TensorFlow's host tracer can write to freed memory as its profile is collected (tsl's
    TraceMeRecorder::Consume keeps pointers to cross-thread events in per-thread deques that a growing vector then
    copies; libstdc++'s deque cannot be moved without a copy there), killing the worker with SIGSEGV or SIGABRT
    ("double free or corruption") in a few launches of ten. That kills the user's job early (at the end of the
    window's first iterations), through no fault of its own: the job is launched again, the failed launch's
    folders kept in `failed_launch_<n>/`; a third such crash runs the last launch without TensorFlow's profiler
    (steps, calibration and clocks still recorded). Single-host jobs only: the other hosts' launchers would not
    know to relaunch. Returns what was done when a relaunch is due (the job updated for it), else ""."""
    crashed = tf_stop_crashes(job, result) if job.launch.backend in ("tf", "horovod") else []
    if not crashed:
        return ""
    attempt = job.profile.launch_attempt
    what = (f"dprorun: rank(s) {crashed} died inside TensorFlow's profiler stop (launch {attempt}; a TensorFlow "
            f"defect in collecting the host trace, not the script's)")
    if job.launch.nnodes > 1:
        print(f"{what}; a job across hosts is not relaunched: run it again, or with --no-kineto (no "
              f"TensorFlow profiler)", file=sys.stderr, flush=True)
        return ""
    kept = os.path.join(job.output.run_dir, f"failed_launch_{attempt}")
    os.makedirs(kept, exist_ok=True)
    for folder in rank_folders(job.output.run_dir).values():
        shutil.move(folder, os.path.join(kept, os.path.basename(folder)))
    job.profile.launch_attempt = attempt + 1
    if job.profile.launch_attempt == TF_STOP_CRASH_LAUNCHES:
        job.profile.kineto = False
    how = "with the profiler" if job.profile.kineto else "without TensorFlow's profiler (no op-level profile)"
    detail = (f"{how} (launch {job.profile.launch_attempt} of at most {TF_STOP_CRASH_LAUNCHES}; the failed launch's "
              f"files are in {kept})")
    print(f"{what}; launching the job again {detail}", file=sys.stderr, flush=True)
    try:
        write_manifest(job, "running", {"relaunched": {"launch": job.profile.launch_attempt, "crashed_ranks": crashed,
                                                       "cause": "TensorFlow profiler stop",
                                                       "profiler": job.profile.kineto}})
    except OSError:
        pass
    return f"{what[len('dprorun: '):]}; launched the job again {detail}"


def _launch_once(job: JobConfig) -> LaunchResult:
    make_private_dir(job.output.run_dir)
    job.low_disk = low_disk(job)
    if job.low_disk:
        print(f"dprorun: warning: {job.low_disk}", file=sys.stderr, flush=True)
    try:
        if job.launch.node_rank == 0:  # node 0 owns the run directory, which the others may share (a shared disk)
            write_manifest(job, "running")
    except OSError as exc:
        print(f"dprorun: warning: cannot write the manifest ({exc.strerror})", file=sys.stderr, flush=True)
    started = time.monotonic()
    if job.launch.backend == "horovod":
        result = _launch_horovod(job)
    elif job.launch.backend == "mxnet":
        from dprorun.launch_ps import launch_ps

        with output_redrawn_in_place(job.output.json_summary):
            result = launch_ps(job)
    elif job.launch.launcher == "torchrun":
        result = _launch_torchrun(job)
    else:
        with output_redrawn_in_place(job.output.json_summary):
            result = _launch_elastic(job)
    result.elapsed_s = time.monotonic() - started
    return result


LOOPBACK_RENDEZVOUS = "dprorun-static-loopback"
NODES_RENDEZVOUS = "dprorun-static"


def _register_rendezvous() -> None:
    """torch's static rendezvous with a new store for each attempt, under two names of dprorun's own.

    LOOPBACK_RENDEZVOUS (one node): torch's TCPStore server listens on every interface whatever address it is
    given; for a single-node job nothing outside this host needs it, so the store is handed a socket bound to
    127.0.0.1 (TCPStore's `master_listen_fd`). NODES_RENDEZVOUS (across nodes): node 0's store as torch's.
    When torch elastic restarts the ranks (--max-restarts), the next attempt gets a store of its own on a new port:
    its ranks take their store as it is (torch's rendezvous counts on a new store for each retry), and torch's
    static rendezvous hands them the last attempt's, whose keys then held the dead ranks' addresses (gloo
    "connectFullMesh failed ... Connection refused" in the new attempt, under torchrun too). Across nodes, node 0
    says the new store's port through the old store, which it keeps serving. (Names other than "static": torch's
    launcher would otherwise pin the ranks to the first store's port.)"""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry
    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import create_rdzv_handler

    def next_rendezvous(handler):
        handler.rounds = getattr(handler, "rounds", 0) + 1
        if handler.rounds > 1:  # a restart
            if handler.get_backend() == LOOPBACK_RENDEZVOUS:
                handler.master_port = 0
                _open_loopback_store(handler)
            else:
                _next_store_across_nodes(handler)
        return type(handler).__mro__[1].next_rendezvous(handler)

    def creator(name: str, loopback: bool):
        def create(params):
            handler = create_rdzv_handler(params)  # torch's static rendezvous, reporting this backend's name
            handler.__class__ = type(f"Restartable{type(handler).__name__}", (type(handler),),
                                     {"get_backend": lambda self: name, "next_rendezvous": next_rendezvous})
            if loopback:
                _open_loopback_store(handler)
            return handler
        return create

    for name, loopback in ((LOOPBACK_RENDEZVOUS, True), (NODES_RENDEZVOUS, False)):
        try:
            rendezvous_handler_registry.register(name, creator(name, loopback))
        except ValueError:
            pass  # already registered in this process (autotune launches several times)


def _next_store_across_nodes(handler) -> None:
    """A restart across nodes: node 0 opens a store on a free port and writes its port into the attempt before's
    store (kept open for the other nodes to read it); the others wait for that key and join the new store."""
    from torch.distributed import TCPStore

    previous = handler._store
    key = f"dprorun/store_of_round_{handler.rounds}"
    if handler.rank == 0:
        handler.earlier_stores = [*getattr(handler, "earlier_stores", []), previous]
        handler._store = TCPStore(handler.master_addr, 0, handler.world_size, True, handler.timeout, multi_tenant=True,
                                  wait_for_workers=False)  # the others learn its port after this
        previous.set(key, str(handler._store.port))
    else:
        port = int(previous.get(key))  # waits as long as the store's timeout for node 0's restart
        handler._store = TCPStore(handler.master_addr, port, handler.world_size, False, handler.timeout)
    handler.master_port = handler._store.port


def _open_loopback_store(handler) -> None:
    """The handler's TCPStore, listening on 127.0.0.1 at its port (0: a free one, then the handler's port)."""
    import datetime

    from torch.distributed import TCPStore

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", handler.master_port))
    listener.listen(1024)
    handler.master_port = listener.getsockname()[1]
    timeout = handler.timeout if isinstance(handler.timeout, datetime.timedelta) else \
        datetime.timedelta(seconds=float(handler.timeout))
    try:
        handler._store = TCPStore("127.0.0.1", handler.master_port, handler.world_size, True, timeout,
                                  multi_tenant=True, master_listen_fd=listener.fileno())
    except BaseException:
        listener.close()
        raise
    # the store owns the socket from here on and closes it when it goes (checked): the Python object lets it go,
    # or its own close at garbage collection closed the number again, whatever held it by then (a ResourceWarning
    # at every job's end under PYTHONWARNINGS / -X dev, and a hazard for a second launch in one process)
    listener.detach()


def _launch_elastic(job: JobConfig) -> LaunchResult:
    with ranks_environment(rank_environment(job)):  # torch elastic's workers inherit this process's environment
        return _launch_elastic_now(job)


@contextlib.contextmanager
def ranks_environment(env: dict[str, str]):
    """This process's environment with `env` for one launch, restored after it: a launch's variables (a trial's
    TF_XLA_FLAGS, its strategy file) must not reach the next launch of the same dprorun (autotune's rounds and
    its final run; they once ran every TensorFlow job after an XLA trial with XLA on)."""
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _launch_elastic_now(job: JobConfig) -> LaunchResult:
    from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs, SignalException, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    port = job.launch.master_port or free_port(job.launch.master_addr if job.launch.nnodes == 1 else "0.0.0.0")
    entrypoint, args = split_command(job.command)
    _register_rendezvous()
    backend = NODES_RENDEZVOUS
    if job.launch.nnodes == 1 and job.launch.master_addr in ("127.0.0.1", "localhost"):
        backend = LOOPBACK_RENDEZVOUS
    settings = dict(
        min_nodes=job.launch.nnodes,
        max_nodes=job.launch.nnodes,
        nproc_per_node=job.launch.nproc_per_node,
        run_id=job.profile.job_id,
        role=job.launch.role,  # "default" as torchrun names it (ROLE_NAME; torch's own default differs)
        rdzv_endpoint=f"{job.launch.master_addr}:{port}",
        rdzv_backend=backend,
        rdzv_configs={"rank": job.launch.node_rank,
                      "timeout": job.launch.join_timeout_s or (900 if job.launch.nnodes > 1 else 60)},
        max_restarts=0,
        monitor_interval=0.1,
        logs_specs=DefaultLogsSpecs(log_dir=os.path.join(job.output.run_dir, "logs"),
                                    tee=Std.NONE if job.low_disk else Std.ALL,
                                    local_ranks_filter=set(job.launch.console_ranks or ()) or None),
        log_line_prefix_template="[rank${rank}]: ",
        shutdown_timeout=5,  # seconds between SIGTERM and SIGKILL at teardown (torch >= 2.12; 30 s before)
    )
    settings.update(_agent_settings(job.launch.agent))
    known = {f.name for f in dataclasses.fields(LaunchConfig)}
    config = LaunchConfig(**{key: value for key, value in settings.items() if key in known})
    with Watchdog(job.launch.timeout_s) as watchdog, _what_the_agent_logs() as agent_log:
        try:
            elastic_launch(config, entrypoint)(*args)
            result = LaunchResult(0, "all ranks finished")
        except ChildFailedError as err:
            result = _child_failed(err, job, agent_log.stopped_pids)
        except SignalException as exc:
            signum = int(exc.sigval)
            if watchdog.fired:
                return LaunchResult(124, f"timed out after {job.launch.timeout_s:g} s (--timeout); all ranks stopped")
            return LaunchResult(128 + signum, f"interrupted by {signal_name(signum)}; all ranks stopped")
        except Exception as exc:  # rendezvous / store errors: before any rank ran
            return LaunchResult(1, _launch_error(exc, job, port))
    return _with_restarts(result, job, getattr(config.logs_specs, "_run_log_dir", None), agent_log.first_failures)


@dataclasses.dataclass
class AgentLog:
    """What torch elastic's agent logs as it stops ranks after a failure, read off its log records."""

    stopped_pids: set[int] = dataclasses.field(default_factory=set)  # sent its closing signal (SIGTERM, then SIGKILL)
    # (exit code, local rank) of each failed attempt's first failure, in attempt order
    first_failures: list[tuple[int, int]] = dataclasses.field(default_factory=list)


@contextlib.contextmanager
def _what_the_agent_logs():
    """The agent's log records during a launch: the pids it sends its closing signal (those ranks ended because of
    the stop, whatever signal ended them) and each failed attempt's first failure (a rank the OOM killer ended
    leaves no error file; with --max-restarts the agent's record is what names it)."""
    import logging

    seen = AgentLog()

    def note(record: logging.LogRecord) -> bool:
        message = str(record.msg)
        if message.startswith("Sending process %s closing signal") and record.args:
            seen.stopped_pids.add(int(record.args[0]))
        elif message.startswith("failed (exitcode: %s) local_rank: %s") and len(record.args or ()) >= 2:
            seen.first_failures.append((int(record.args[0]), int(record.args[1])))
        return True

    logger = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    logger.addFilter(note)
    try:
        yield seen
    finally:
        logger.removeFilter(note)


# torch 2.13 on the CPU: a DistributedDataParallel built under TORCH_DISTRIBUTED_DEBUG=DETAIL (its gloo wrapper group)
# ends the rank in SIGSEGV at once, with plain torchrun as well
DETAIL_SEGFAULT_HINT = ("TORCH_DISTRIBUTED_DEBUG=DETAIL is set: under it torch 2.13's DistributedDataParallel on gloo "
                        "ends its ranks in SIGSEGV at its construction, with plain torchrun too; INFO does not")


# Lightning's refusal of a launched world other than its devices x num_nodes: a script that starts its ranks itself
LIGHTNING_WORLD_MISMATCH = "in Lightning, but the product"
LIGHTNING_WORLD_HINT = ("Lightning starts its ranks itself from one process: launch one (`dprorun python train.py`; a "
                        "dry run for N ranks: `--dry-run -np N --local-np 1`), or give -np its devices x num_nodes")


def _child_failed(err, job: JobConfig, stopped_pids: set[int]) -> LaunchResult:
    """The launch's result where a rank failed: the rank whose failure stopped the job named, with its cause."""
    rank, failure = _root_failure(err, stopped_pids)
    code = failure.exitcode
    hint = ""
    if code < 0:
        how = f"was killed by signal {signal_name(-code)}"
        if -code == signal.SIGABRT:
            hint = exit_abort_hint(os.path.join(job.output.run_dir, "logs"), failure.local_rank)
        elif -code == signal.SIGSEGV and os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL":
            hint = DETAIL_SEGFAULT_HINT + f" (this torch: {sys.modules['torch'].__version__})" \
                if "torch" in sys.modules else DETAIL_SEGFAULT_HINT
        code = 128 - code
    else:
        how = f"exited with code {code}"
    detail = error_message(failure) or (
        last_words(os.path.join(job.output.run_dir, "logs"), failure.local_rank) if code > 0 else "")
    message = f"rank {rank} (local rank {failure.local_rank}, pid {failure.pid}) {how}"
    if detail:
        message += f": {detail}" + missing_module_hint(detail, job.launch.backend, job.command)
        if LIGHTNING_WORLD_MISMATCH in detail and job.launch.world_size > 1:
            message += f"; {LIGHTNING_WORLD_HINT}"
    hint = hint or error_hint(failure)
    others = sorted(r for r in err.failures if r != rank)
    if others:
        message += f" (also failed: ranks {others})"
    if job.launch.nnodes > 1 and code > 0 and _failed_because_of_a_peer(failure):
        hint = "its error says a peer failed first: a rank on another node, which that node's dprorun names"
    if hint:
        message += f"; {hint}"
    return LaunchResult(code or 1, message, rank,
                        {r: {"exitcode": f.exitcode, "pid": f.pid} for r, f in err.failures.items()})


def _with_restarts(result: LaunchResult, job: JobConfig, run_log_dir: Optional[str],
                   first_failures: Optional[list[tuple[int, int]]] = None) -> LaunchResult:
    """A launch torch elastic restarted (--max-restarts): each failed attempt named in the result's relaunches (the
    run's summary and manifest say them), with where its files went; the outcome says which attempt it was."""
    from dprorun.layout import FAILED_ATTEMPT_DIR

    failed = failed_attempts(run_log_dir, job.launch.node_rank * job.launch.nproc_per_node, CONSEQUENTIAL_ERRORS,
                             first_failures)
    if not failed:
        return result
    for attempt in failed:
        kept = os.path.join(job.output.run_dir, FAILED_ATTEMPT_DIR.format(attempt.attempt))
        where = f"; its files are in {kept}" if os.path.isdir(kept) else "; it left no profile"
        result.relaunches.append(f"torch elastic restarted the ranks after attempt {attempt.attempt} failed "
                                 f"(--max-restarts {job.launch.agent.max_restarts}): {attempt.cause}{where}")
    last = failed[-1].attempt + 1
    result.message += f" (attempt {last}, after {len(failed)} restart{'s' if len(failed) > 1 else ''})"
    return result


# what a rank raises because another rank failed first: Horovod shut down, a gloo peer's connection closed,
# a TensorFlow collective aborted
# what a rank raises because a peer failed or left; HorovodInternalError also wraps a collective's own failure
PEER_LOST_ERRORS = ("Horovod has been shut down", "Connection closed by peer", "Connection reset by peer",
                    "Collective ops is aborted by")
CONSEQUENTIAL_ERRORS = ("HorovodInternalError", *PEER_LOST_ERRORS)


# a framework the ranks could not import -> what fits (its own environment, or its installer)
MISSING_MODULE_HINTS = {
    "mxnet": "MXNet jobs run with --backend mxnet, whose roles run in MXNet's own environment (scripts/install-mxnet "
             "makes it, or --mxnet-python names one)",
    "horovod": "Horovod is not installed in this Python: scripts/install-horovod builds it for this torch",
    "tensorflow": "TensorFlow is not installed in this Python: scripts/install-tf installs it",
}


def _importable_here(module: str) -> bool:
    import importlib.util

    try:
        return bool(module) and importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def missing_module_hint(detail: str, backend: str, command: Sequence[str] = ()) -> str:
    """"; <what fits>" for a rank that failed importing a module (ModuleNotFoundError), else "": the ranks' `python`
    found on PATH is another interpreter than dprorun's, which has the module (an environment not activated, dprorun
    installed apart; a module missing here too is the script's own matter), or a framework dprorun installs for
    itself."""
    if "No module named '" not in detail:
        return ""
    missing = detail.split("No module named '", 1)[1].split("'", 1)[0].split(".")[0]
    head = shutil.which(command[0]) if command and os.path.basename(command[0]).startswith("python") else None
    if head and os.path.realpath(head) != os.path.realpath(sys.executable) and _importable_here(missing):
        return (f"; the ranks ran {head}, another Python than dprorun's ({sys.executable}), which has {missing}: "
                "activate the environment that has the job's modules, or give its python's path")
    for module, hint in MISSING_MODULE_HINTS.items():
        if f"No module named '{module}" in detail and not (module == "mxnet" and backend == "mxnet"):
            return f"; {hint}"
    return ""


def _root_failure(err, stopped_pids=frozenset()) -> tuple[int, object]:
    """The failure that caused the stop. A rank killed by a signal (SIGKILL from the OOM killer, SIGSEGV) comes
    first: the others then fail because their peer vanished (gloo raises) or because the agent stopped them
    (SIGTERM), and either can be stamped earlier, as a killed rank leaves no error file. Then ranks that exited
    with an error of their own, then those whose error says a peer failed first (a TensorFlow collective aborted as
    its peer's socket closed can be stamped before the peer's own error: seen in CI), then the rest; the earliest
    within a class. A rank the agent stopped (`stopped_pids`, its SIGTERM sent) is of the rest, also where its
    SIGKILL ended it: a rank waiting in C++ for a peer (a store's wait in init_process_group while the peer failed
    before it) does not run the hooks' SIGTERM handler, and the agent's SIGKILL 30 s later was named as the cause."""
    def rank_of(item) -> tuple:
        rank, failure = item
        code = failure.exitcode
        if failure.pid in stopped_pids and code in (-signal.SIGTERM, -signal.SIGKILL):
            cls = 3  # the agent's own stop: SIGKILLed when it outlived the SIGTERM (a wait in C++ for a peer)
        elif code < 0 and code != -signal.SIGTERM:
            cls = 0
        elif code not in (-signal.SIGTERM, 128 + signal.SIGTERM):
            cls = 2 if _failed_because_of_a_peer(failure) else 1
        else:
            cls = 3
        return cls, failure.timestamp, rank

    return min(err.failures.items(), key=rank_of)


def _failed_because_of_a_peer(failure) -> bool:
    """Whether a rank's recorded error is what a rank raises because another one failed (CONSEQUENTIAL_ERRORS)."""
    try:
        message = failure.message
    except Exception:
        return False
    if isinstance(message, dict):
        message = message.get("message", "")
    return any(cause in str(message or "") for cause in CONSEQUENTIAL_ERRORS)


def _launch_error(exc: Exception, job: JobConfig, port: int) -> str:
    text = str(exc)
    if "EADDRINUSE" in text or "address already in use" in text.lower():
        return (f"port {port} on {job.launch.master_addr} is already in use (--master-port); choose another port, or "
                "leave --master-port out for a free one")
    if "timed out" in text.lower() or "timeout" in type(exc).__name__.lower():
        return (f"rendezvous with {job.launch.master_addr}:{port} timed out: not every node joined "
                f"({job.launch.nnodes} expected); {type(exc).__name__}: {text.splitlines()[0] if text else ''}")
    first = text.splitlines()[0] if text else ""
    if isinstance(exc, ValueError) and "Expecting value" in text:  # json.JSONDecodeError from an error file
        return (f"a rank failed and its error file under {job.output.run_dir}/logs could not be read (empty: was the "
                f"disk full?); see the rank's output above")
    return f"could not start the ranks: {type(exc).__name__}: {first}"


# torchrun's agent flags (config.ElasticAgentOptions field -> torch elastic's LaunchConfig field, torchrun's flag)
AGENT_FIELDS = (("numa_binding", "numa_options", "--numa-binding"),
                ("signals_to_handle", "signals_to_handle", "--signals-to-handle"),
                ("event_log_handler", "event_log_handler", "--event-log-handler"),
                ("duplicate_stdout_filters", "duplicate_stdout_filters", "--duplicate-stdout-filters"),
                ("duplicate_stderr_filters", "duplicate_stderr_filters", "--duplicate-stderr-filters"),
                ("virtual_local_rank", "virtual_local_rank", "--virtual-local-rank"),
                ("shutdown_timeout_s", "shutdown_timeout", "--shutdown-timeout"),
                ("max_restarts", "max_restarts", "--max-restarts"))


def _agent_given(agent: ElasticAgentOptions) -> list[tuple[str, object, str]]:
    """(LaunchConfig field, value, torchrun flag) of each agent flag the user gave."""
    given = [(field, getattr(agent, name), flag) for name, field, flag in AGENT_FIELDS]
    return [(field, value, flag) for field, value, flag in given
            if not (value is None or value is False or value in ([], ""))]  # a timeout of 0 is given


def _agent_settings(agent: ElasticAgentOptions) -> dict:
    """torchrun's agent flags the user gave as torch elastic's LaunchConfig fields."""
    settings = {field: value for field, value, _ in _agent_given(agent)}
    if "numa_options" in settings:
        from torch.numa.binding import AffinityMode, NumaOptions

        settings["numa_options"] = NumaOptions(affinity_mode=AffinityMode(agent.numa_binding))
    return settings


def _agent_flags(agent: ElasticAgentOptions) -> list[str]:
    """The same as torchrun's flags (dprorun --launcher torchrun)."""
    return [flag if value is True else f"{flag}={','.join(value) if isinstance(value, list) else value}"
            for _, value, flag in _agent_given(agent)]


def _launch_torchrun(job: JobConfig) -> LaunchResult:
    """Hand rendezvous and process management to the torchrun CLI, with the hooks on PYTHONPATH."""
    entrypoint, args = split_command(job.command)
    cmd = [sys.executable, "-m", "torch.distributed.run",
           f"--nnodes={job.launch.nnodes}", f"--nproc-per-node={job.launch.nproc_per_node}",
           f"--node-rank={job.launch.node_rank}", f"--master-addr={job.launch.master_addr}",
           f"--master-port={job.launch.master_port or free_port(job.launch.master_addr)}",
           f"--rdzv-id={job.profile.job_id}", "--tee=3", f"--role={job.launch.role}",
           *([f"--local-ranks-filter={','.join(map(str, job.launch.console_ranks))}"] if job.launch.console_ranks
             else []),
           f"--log-dir={os.path.join(job.output.run_dir, 'logs')}", *_agent_flags(job.launch.agent)]
    if entrypoint == sys.executable or os.path.basename(entrypoint).startswith("python"):
        cmd += [a for a in args if a != "-u"]
    else:
        cmd += ["--no-python", entrypoint] + args
    result = _run_engine(cmd, job, "torchrun")
    return _with_restarts(result, job, _newest_log_run_dir(job)) if job.launch.agent.max_restarts else result


def _newest_log_run_dir(job: JobConfig) -> Optional[str]:
    """torch elastic's log folder of this job's newest launch (`RUN/logs/<job id>_<suffix>/`), None where none."""
    logs = os.path.join(job.output.run_dir, "logs")
    try:
        runs = [os.path.join(logs, name) for name in os.listdir(logs) if name.startswith(job.profile.job_id + "_")]
    except OSError:
        return None
    return max(runs, key=os.path.getmtime, default=None)


HOROVOD_TIMELINE = "horovod_timeline.json"


def horovodrun_path() -> Optional[str]:
    """horovodrun on PATH, else the one installed beside this Python (`/venv/bin/dprorun` run without the
    environment activated: its horovodrun is not on PATH, and the job was refused as if Horovod were missing)."""
    beside = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    return shutil.which("horovodrun") or (beside if os.access(beside, os.X_OK) else None)


def _launch_horovod(job: JobConfig) -> LaunchResult:
    """Hand the job to horovodrun (Gloo controller) with Horovod's timeline written into the run directory."""
    horovodrun = horovodrun_path()
    if horovodrun is None:
        return LaunchResult(2, "horovodrun was not found: install Horovod (scripts/install-horovod builds stock "
                               "Horovod 0.28.1 for this torch)")
    timeline = os.path.join(job.output.run_dir, HOROVOD_TIMELINE)
    cmd = [horovodrun, "-np", str(job.launch.world_size), "--gloo"]
    mode = horovod_timeline_mode(job)
    if mode == "job":
        cmd += ["--timeline-filename", timeline]
    elif mode == "window":  # the hooks record it in the window's detailed tier (hvd.start_timeline / stop_timeline)
        cmd += ["--timeline-filename", "DYNAMIC"]
        job = dataclasses.replace(job, profile=dataclasses.replace(job.profile, horovod_timeline=timeline))
    if job.launch.hosts:
        cmd += ["-H", ",".join(f"{host}:{job.launch.nproc_per_node}" for host in job.launch.hosts)]
    cmd += list(job.horovod.ssh_args) + list(job.horovod.args) + list(job.command)
    result = _run_engine(cmd, job, "horovodrun")
    wanted = user_horovod_timeline()
    if mode == "job" and wanted:
        _copy_timeline_to_user(timeline, wanted, job.output.quiet)
    return result


def user_horovod_timeline() -> Optional[str]:
    """The timeline file the user asked Horovod for through HOROVOD_TIMELINE (as horovodrun users do), or None
    (unset, or Horovod's DYNAMIC mode)."""
    value = os.environ.get("HOROVOD_TIMELINE", "").strip()
    return value if value and value.upper() != "DYNAMIC" else None


def _copy_timeline_to_user(timeline: str, wanted: str, quiet: bool) -> None:
    """The whole job's timeline, recorded in the run directory, copied where HOROVOD_TIMELINE asked for it
    (horovodrun's --timeline-filename, which dprorun sets, takes the place of the variable in the ranks)."""
    if not os.path.exists(timeline):
        return
    try:
        shutil.copyfile(timeline, wanted)
    except OSError as exc:
        print(f"dprorun: warning: Horovod's timeline is in {timeline}, not copied to HOROVOD_TIMELINE's {wanted}: "
              f"{exc}", file=sys.stderr)
        return
    if not quiet:
        print(f"dprorun: Horovod's timeline of the whole job written to {wanted} (HOROVOD_TIMELINE)", file=sys.stderr)


HOROVOD_TF_MODULES = ("horovod.tensorflow", "horovod.keras", "import horovod.tensorflow")


def horovod_timeline_mode(job: JobConfig) -> str:
    """--horovod-timeline as run. auto: "window" where the script imports horovod.tensorflow (TensorFlow's profiler
    does not record Horovod's asynchronous ops: each tensor's all-reduce end comes from the timeline), else "off":
    starting the timeline in the window needs HOROVOD_TIMELINE=DYNAMIC for the whole job, which made plain horovodrun
    jobs here 14 % (horovod.tensorflow conv net) and 20 % (horovod.torch MLP) slower in every iteration, recorded or
    not (benchmarks/RESULTS.md), and horovod.torch's hooks time each all-reduce without it. A HOROVOD_TIMELINE file
    set by the user makes it "job" (unless off: the variable then reaches Horovod untouched)."""
    mode = job.horovod.timeline
    if mode in ("auto", "window") and user_horovod_timeline():
        return "job"  # the user asked Horovod for the whole job's timeline (HOROVOD_TIMELINE): recorded and copied
    if mode != "auto":
        return mode
    script = next((a for a in job.command if a.endswith(".py")), None)
    try:
        with open(script, encoding="utf-8", errors="replace") as handle:
            text = handle.read()
    except (OSError, TypeError):
        return "off"
    return "window" if any(name in text for name in HOROVOD_TF_MODULES) else "off"


def _run_engine(cmd: list[str], job: JobConfig, engine: str) -> LaunchResult:
    """Run a launcher CLI as a child with the hooks' environment; forward SIGINT/SIGTERM/SIGHUP; --timeout stops it."""
    env = dict(os.environ)
    env.update(rank_environment(job))
    code, signum, timed_out = call_forwarding_signals(cmd, env, job.launch.timeout_s, job.output.json_summary)
    if timed_out:
        return LaunchResult(124, f"timed out after {job.launch.timeout_s:g} s (--timeout); all ranks stopped")
    if signum is not None:
        return LaunchResult(128 + signum, f"interrupted by {signal_name(signum)}")
    if code != 0:
        named = raised_in_ranks(job.output.run_dir, job.launch.world_size)
        return LaunchResult(code if code > 0 else 128 - code, f"{engine} exited with code {code} " + (
            f"({named})" if named else "(its output above names the failing rank)"))
    return LaunchResult(0, "all ranks finished")


def _error_file_message(path: str) -> str:
    """The message of an error file in torch elastic's format ("" where there is none, or it cannot be read)."""
    try:
        with open(path, encoding="utf-8") as handle:
            message = json.load(handle)["message"]["message"]
    except (OSError, ValueError, KeyError, TypeError):
        return ""
    return message if isinstance(message, str) else ""


def raised_in_ranks(run_dir: str, world_size: int) -> str:
    """The ranks (with folders on this host) whose script raised, from the hooks' records: those whose error is
    their own named first with it, the ones that failed because of them after; where every error is Horovod's
    (HorovodInternalError), those that tell of no peer lost. "" when no rank recorded one."""
    from dprorun.layout import EVENTS_FILE, SCRIPT_RAISED, horovod_error_file, rank_dir

    raised = {}
    for rank in range(world_size):
        try:
            with open(os.path.join(rank_dir(run_dir, rank), EVENTS_FILE), encoding="utf-8") as handle:
                warnings = json.load(handle).get("warnings") or []
        except (OSError, ValueError, AttributeError):
            warnings = []
        error = next((w[len(SCRIPT_RAISED):] for w in warnings if isinstance(w, str) and w.startswith(SCRIPT_RAISED)),
                     None) or _error_file_message(horovod_error_file(run_dir, rank))
        if error:
            raised[rank] = error
    causes = {r: e for r, e in raised.items() if not any(c in e for c in CONSEQUENTIAL_ERRORS)}
    if not causes:  # Horovod's own failure on every rank that raised (op=hvd.Adasum without MPI: "No Adasum
        # operation enabled", both ranks, and nothing named): named where it tells of no peer lost
        causes = {r: e for r, e in raised.items() if not any(c in e for c in PEER_LOST_ERRORS)}
    if not causes:
        return ""
    by_error: dict[str, list[int]] = {}
    for rank, error in sorted(causes.items()):
        by_error.setdefault(error_line(error), []).append(rank)
    named = "; ".join(f"rank {ranks[0]} raised {error}" if len(ranks) == 1 else f"ranks {ranks} raised {error}"
                      for error, ranks in by_error.items())
    after = sorted(set(raised) - set(causes))
    return named + (f"; then rank(s) {after} failed with it" if after else "")
