"""Launch of a parameter-server job (`--backend mxnet`): the scheduler, the servers and the workers of an MXNet
kvstore job on this host, with MXNet's own Python."""
from __future__ import annotations

import importlib.util
import os
import signal
import sys
import time

from dprorun.config import JobConfig
from dprorun.procs import LaunchResult, Watchdog, error_message, free_port, rank_environment, signal_name, \
    split_command

MXNET_VENV_DEFAULT = os.path.join("~", ".cache", "dprorun", "mxnet-venv")


def mxnet_python(job: JobConfig) -> str:
    """The interpreter of an MXNet job's roles when its command starts with python: --mxnet-python, else
    $DPRO_MXNET_PYTHON, else this Python if it can import mxnet, else the environment scripts/install-mxnet made."""
    chosen = job.launch.mxnet_python or os.environ.get("DPRO_MXNET_PYTHON", "")
    if chosen:
        return chosen
    if importlib.util.find_spec("mxnet") is not None:
        return sys.executable
    venv = os.path.expanduser(os.environ.get("DPRO_MXNET_VENV", MXNET_VENV_DEFAULT))
    candidate = os.path.join(venv, "bin", "python")
    if os.path.exists(candidate):
        return candidate
    raise FileNotFoundError(f"no Python with MXNet was found (not importable here, and no {candidate}): run "
                            "scripts/install-mxnet, or give --mxnet-python")


def mxnet_roles(job: JobConfig) -> list[tuple[str, int]]:
    """(role, index) of every process of a parameter-server job, in start order: scheduler, servers, workers."""
    return ([("scheduler", 0)] + [("server", i) for i in range(job.launch.servers)]
            + [("worker", i) for i in range(job.launch.nproc_per_node)])


SHUTDOWN_GRACE_S = 20.0


def _workers_succeeded(context, roles: list[tuple[str, int]]) -> bool:
    """Whether every worker process has exited with 0 (torch elastic's subprocess context keeps a Popen per
    slot)."""
    handlers = getattr(context, "subprocess_handlers", None)
    if not handlers:
        return False
    codes = [handlers[slot].proc.poll() for slot, (role, _) in enumerate(roles) if role == "worker"]
    return bool(codes) and all(code == 0 for code in codes)


def launch_ps(job: JobConfig) -> LaunchResult:
    """A kvstore parameter-server job on this host: the scheduler, `servers` servers and `nproc_per_node` workers
    (job.launch), each the user's command with its DMLC_* role variables (MXNet turns a server or scheduler
    process into that role when it imports mxnet). torch elastic's start_processes spawns them, tees their output
    with a role prefix into run_dir/logs, and stops them all when one fails."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std, start_processes
    from torch.distributed.elastic.multiprocessing.api import SignalException

    try:
        entrypoint, args = _role_command(job)
    except FileNotFoundError as exc:
        return LaunchResult(2, str(exc))
    roles = mxnet_roles(job)
    envs = _role_environments(job, roles)
    prefixes = {slot: (f"[{role}]: " if role == "scheduler" else f"[{role}{index}]: ")
                for slot, (role, index) in enumerate(roles)}
    logs = DefaultLogsSpecs(log_dir=os.path.join(job.output.run_dir, "logs"),
                            tee=Std.NONE if job.low_disk else Std.ALL)
    context = None

    def stop(signum, frame):  # as torch elastic's agent does: the loop below closes every role
        raise SignalException(f"dprorun got {signal_name(signum)}", sigval=signal.Signals(signum))

    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    with Watchdog(job.launch.timeout_s) as watchdog:
        try:
            context = start_processes(name=job.profile.job_id or "mxnet", entrypoint=entrypoint,
                                      args={slot: tuple(args) for slot in envs}, envs=envs, logs_specs=logs,
                                      log_line_prefixes=prefixes)
            result = _wait_for_roles(context, roles)
            if result is None:
                return LaunchResult(0, "all workers finished (scheduler and servers stopped)")
        except SignalException as exc:
            if context is not None:
                context.close()
            signum = int(exc.sigval)
            if watchdog.fired:
                return LaunchResult(124, f"timed out after {job.launch.timeout_s:g} s (--timeout); every role stopped")
            return LaunchResult(128 + signum, f"interrupted by {signal_name(signum)}; every role stopped")
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
    if not result.failures:
        return LaunchResult(0, "all roles finished")
    return _failed_role(result, roles)


def _role_command(job: JobConfig) -> tuple[str, list[str]]:
    """The entry point and arguments every role runs: `python train.py` with MXNet's interpreter."""
    python = mxnet_python(job)
    head = job.command[0] if job.command else ""
    if head.endswith(".py") or os.path.basename(head).startswith("python"):
        command = job.command[1:] if not head.endswith(".py") else job.command
        return python, ["-u"] + command
    return split_command(job.command)


def _role_environments(job: JobConfig, roles: list[tuple[str, int]]) -> dict[int, dict[str, str]]:
    """Per role slot: the ranks' variables, ps-lite's DMLC_* ones (on loopback) and the role itself."""
    common = rank_environment(job)
    if job.strategy_file:  # a strategy's key-partition bound goes to every role (workers place keys by it)
        from dprorun.strategy import load_strategy

        bound = load_strategy(job.strategy_file).mxnet_bigarray_bound
        if bound is not None:
            common["MXNET_KVSTORE_BIGARRAY_BOUND"] = str(int(bound))
    common.update({"DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": str(job.launch.master_port or free_port()),
                   "DMLC_NUM_SERVER": str(job.launch.servers), "DMLC_NUM_WORKER": str(job.launch.nproc_per_node),
                   "DMLC_NODE_HOST": "127.0.0.1", "DMLC_INTERFACE": "lo"})
    return {slot: {**common, "DMLC_ROLE": role, "DPRO_MX_INDEX": str(index)}
            for slot, (role, index) in enumerate(roles)}


def _wait_for_roles(context, roles: list[tuple[str, int]]):
    """torch elastic's result once every role ended, or None when every worker finished and the scheduler and
    servers (which end with them, ps-lite's shutdown) had not after SHUTDOWN_GRACE_S: those are then stopped."""
    workers_done_at = None
    while True:
        result = context.wait(timeout=1.0, period=0.1)
        if result is not None:
            return result
        if _workers_succeeded(context, roles):
            workers_done_at = workers_done_at or time.monotonic()
            if time.monotonic() - workers_done_at > SHUTDOWN_GRACE_S:
                print(f"dprorun: every worker finished; the scheduler and servers had not after "
                      f"{SHUTDOWN_GRACE_S:g} s and were stopped", file=sys.stderr, flush=True)
                context.close()
                return None


def _failed_role(result, roles: list[tuple[str, int]]) -> LaunchResult:
    """The role that failed first named, with its exit code or signal; every role's failure in the details."""
    def order(item):  # a role killed by a signal first (the others then fail or are stopped), then the earliest
        slot, failure = item
        code = failure.exitcode
        return (0 if code < 0 and code != -signal.SIGTERM else 1 if code != -signal.SIGTERM else 2,
                failure.timestamp, slot)

    slot, failure = min(result.failures.items(), key=order)
    role, index = roles[slot]
    name = "the scheduler" if role == "scheduler" else f"{role} {index}"
    code = failure.exitcode
    how = f"was killed by signal {signal_name(-code)}" if code < 0 else f"exited with code {code}"
    detail = error_message(failure)
    message = f"{name} (pid {failure.pid}) {how}" + (f": {detail}" if detail else "")
    message += "; every other role was stopped"
    return LaunchResult(128 - code if code < 0 else (code or 1), message, None,
                        {f"{roles[s][0]}{roles[s][1]}": {"exitcode": f.exitcode, "pid": f.pid}
                         for s, f in result.failures.items()})
