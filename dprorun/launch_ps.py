"""Launch of a parameter-server job (`--backend mxnet`): the scheduler, the servers and the workers of an MXNet
kvstore job, with MXNet's own Python: on this host (loopback), or across hosts (`--nnodes/--node-rank/--master-addr`
or `--hosts`, one dprorun per host): the scheduler on node 0 at the master address and port, every node its own
servers and workers on the address it reaches the master by; the nodes' dprorun processes measure their clocks
against node 0's, stop together when one node's roles fail, and send their traces to node 0 at the end
(dprorun/node_link.py)."""
from __future__ import annotations

import importlib.util
import os
import signal
import socket
import sys
import time
from typing import Optional

from dprorun.config import JobConfig
from dprorun.procs import LaunchResult, Watchdog, error_message, free_port, last_words, rank_environment, signal_name, \
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
    """(role, index) of every process of this node of a parameter-server job, in start order: the scheduler (node 0),
    its servers, its workers; indices count across nodes (node k's first server is k x servers per node)."""
    node, servers, workers = job.launch.node_rank, job.launch.servers, job.launch.nproc_per_node
    return ([("scheduler", 0)] if node == 0 else []) + [("server", node * servers + i) for i in range(servers)] \
        + [("worker", node * workers + i) for i in range(workers)]


SHUTDOWN_GRACE_S = 20.0
PEER_FAILURE_GRACE_S = 5.0  # another node's roles failed: this node's get SIGTERM, then SIGKILL after this


def _workers_succeeded(context, roles: list[tuple[str, int]]) -> bool:
    """Whether every worker process has exited with 0 (torch elastic's subprocess context keeps a Popen per
    slot)."""
    handlers = getattr(context, "subprocess_handlers", None)
    if not handlers:
        return False
    codes = [handlers[slot].proc.poll() for slot, (role, _) in enumerate(roles) if role == "worker"]
    return bool(codes) and all(code == 0 for code in codes)


def launch_ps(job: JobConfig) -> LaunchResult:
    """A kvstore parameter-server job: this node's roles (job.launch; see mxnet_roles), each the user's command with
    its DMLC_* role variables (MXNet turns a server or scheduler process into that role when it imports mxnet).
    torch elastic's start_processes spawns them, tees their output with a role prefix into run_dir/logs, and stops
    them all when one fails; across hosts, when another node's roles fail too."""
    try:
        entrypoint, args = _role_command(job)
    except FileNotFoundError as exc:
        return LaunchResult(2, str(exc))
    _apply_server_count(job)
    link = None
    if job.launch.nnodes > 1:
        from dprorun.node_link import NodeLink

        join_s = job.launch.join_timeout_s or 900.0
        try:
            link = NodeLink.connect(job.launch.node_rank, job.launch.nnodes, job.launch.master_addr,
                                    int(job.launch.master_port), join_s)
            clock = link.probe_clock()
        except Exception as exc:  # node 0's dprorun never came (or, on node 0, its port was taken): nothing started
            return LaunchResult(1, _link_error(job, exc))
        missing = link.missing_nodes(join_s) if job.launch.node_rank == 0 else []
        if missing:  # the scheduler would wait for their roles forever: nothing was started
            link.release_responders(missing)
            return LaunchResult(1, f"not every node joined ({job.launch.nnodes} expected): node(s) {missing} did "
                                   f"not reach node 0's dprorun within {join_s:g} s (--join-timeout)")
        if clock is not None and not job.output.quiet:
            print(f"dprorun: node {clock.node}: clock {clock.offset_us:+.0f} us from node 0's "
                  f"(+- {clock.rtt_us / 2:.0f} us)", file=sys.stderr, flush=True)
    result = _run_roles(job, entrypoint, args, link)
    if link is not None:
        result = _exchange_with_nodes(job, link, result)
    return result


def _link_error(job: JobConfig, exc: Exception) -> str:
    """Why the nodes' link failed: on node 0 a taken port is its own (the link listens on --master-port + 1)."""
    from dprorun.node_link import link_port

    text = str(exc)
    port = link_port(int(job.launch.master_port))
    if job.launch.node_rank == 0 and ("address already in use" in text.lower() or "EADDRINUSE" in text):
        return (f"port {port} on {job.launch.master_addr} is already in use: the nodes' link listens on "
                f"--master-port + 1 (or $DPRO_AGENT_PORT); choose another --master-port")
    return (f"node {job.launch.node_rank} could not reach node 0's dprorun at {job.launch.master_addr}:{port} "
            f"({type(exc).__name__}: {text.splitlines()[0] if text else ''})")


def _apply_server_count(job: JobConfig) -> None:
    """A strategy's server count (all nodes together) replaces --servers (per node) where the nodes divide it."""
    if not job.strategy_file:
        return
    from dprorun.strategy import load_strategy

    total = load_strategy(job.strategy_file).mxnet_servers
    if total is None:
        return
    if total % job.launch.nnodes:
        print(f"dprorun: warning: the strategy's {total} servers do not divide over {job.launch.nnodes} nodes; "
              f"keeping {job.launch.servers} per node", file=sys.stderr, flush=True)
        return
    job.launch.servers = total // job.launch.nnodes


def _run_roles(job: JobConfig, entrypoint: str, args: list[str], link) -> LaunchResult:
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std, start_processes
    from torch.distributed.elastic.multiprocessing.api import SignalException

    roles = mxnet_roles(job)
    envs = _role_environments(job, roles)
    prefixes = {slot: (f"[{role}]: " if role == "scheduler" else f"[{role}{index}]: ")
                for slot, (role, index) in enumerate(roles)}
    logs = DefaultLogsSpecs(log_dir=os.path.join(job.output.run_dir, "logs"),
                            tee=Std.NONE if job.low_disk else Std.ALL)
    context = None

    def stop(signum, frame):  # as torch elastic's agent does: the loop below closes every role
        raise SignalException(f"dprorun got {signal_name(signum)}", sigval=signal.Signals(signum))

    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    with Watchdog(job.launch.timeout_s) as watchdog:
        try:
            context = start_processes(name=job.profile.job_id or "mxnet", entrypoint=entrypoint,
                                      args={slot: tuple(args) for slot in envs}, envs=envs, logs_specs=logs,
                                      log_line_prefixes=prefixes)
            result = _wait_for_roles(context, roles, link)
            if isinstance(result, LaunchResult):
                return result
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
    return _failed_role(result, roles, job.output.run_dir)


def _exchange_with_nodes(job: JobConfig, link, result: LaunchResult) -> LaunchResult:
    """After this node's roles ended: a failure told to the other nodes; the traces sent to node 0 (other nodes), or
    received from every node with their outcome and the nodes' clocks written (node 0)."""
    if result.exit_code != 0:
        link.fail(result.message)
    if job.launch.node_rank != 0:
        try:
            link.send_run_dir(job.output.run_dir, result.exit_code, result.message)
        except Exception as exc:
            print(f"dprorun: warning: node {job.launch.node_rank} could not send its traces to node 0: {exc}; they "
                  f"stay in {job.output.run_dir}", file=sys.stderr, flush=True)
        return result
    received = link.receive_run_dirs(job.output.run_dir, NODE_BUNDLE_TIMEOUT_S)
    try:
        link.write_clocks(job.output.run_dir, 10.0)
    except OSError as exc:
        print(f"dprorun: warning: cannot write the nodes' clocks ({exc})", file=sys.stderr)
    failed = [(peer, doc) for peer, doc in sorted(received.items()) if "missing" in doc or doc.get("exit_code")]
    if result.exit_code == 0 and failed:
        peer, doc = failed[0]
        why = doc.get("missing") or f"node {peer} ({doc['host']}): {doc['message']}"
        return LaunchResult(int(doc.get("exit_code") or 1), why, None, {f"node{p}": d for p, d in failed})
    return result


NODE_BUNDLE_TIMEOUT_S = 120.0


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
    common, server_only = rank_environment(job), {}
    if job.strategy_file:  # a strategy's key-partition bound goes to every role (workers place keys by it)
        from dprorun.strategy import load_strategy

        strategy = load_strategy(job.strategy_file)
        if strategy.mxnet_bigarray_bound is not None:
            common["MXNET_KVSTORE_BIGARRAY_BOUND"] = str(int(strategy.mxnet_bigarray_bound))
        if strategy.mxnet_server_threads is not None:  # the servers' OpenMP threads (replay/ps_cpu.spinning_note)
            server_only["OMP_NUM_THREADS"] = str(int(strategy.mxnet_server_threads))
    if job.launch.nnodes > 1:
        root, port = socket.gethostbyname(job.launch.master_addr), str(job.launch.master_port)
        host, interface = node_address(root)
    else:
        root, port, host, interface = "127.0.0.1", str(job.launch.master_port or free_port()), "127.0.0.1", "lo"
    common.update({"DMLC_PS_ROOT_URI": root, "DMLC_PS_ROOT_PORT": port,
                   "DMLC_NUM_SERVER": str(job.launch.servers * job.launch.nnodes),
                   "DMLC_NUM_WORKER": str(job.launch.nproc_per_node * job.launch.nnodes),
                   "DMLC_NODE_HOST": host, "DMLC_INTERFACE": interface})
    return {slot: {**common, **(server_only if role == "server" else {}), "DMLC_ROLE": role,
                   "DPRO_MX_INDEX": str(index)} for slot, (role, index) in enumerate(roles)}


def node_address(master_ip: str) -> tuple[str, str]:
    """(this host's address towards the master, the interface that holds it): what ps-lite binds and announces."""
    import psutil

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((master_ip, 9))  # no packet is sent: the kernel picks the route and source address
        address = probe.getsockname()[0]
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == address for a in addresses):
            return address, name
    return address, "lo" if address.startswith("127.") else ""


def _wait_for_roles(context, roles: list[tuple[str, int]], link=None):
    """torch elastic's result once every role ended; None when every worker finished and the scheduler and servers
    (which end with them, ps-lite's shutdown) had not after SHUTDOWN_GRACE_S (those are then stopped); a
    LaunchResult when another node's roles failed (this node's are stopped: the job cannot go on)."""
    workers_done_at = None
    checked = time.monotonic()
    while True:
        result = context.wait(timeout=1.0, period=0.1)
        if result is not None:
            return result
        if link is not None and time.monotonic() - checked > 1.0:
            checked = time.monotonic()
            peer = link.peer_failure()
            if peer is not None:  # the job cannot go on: roles blocked in ps-lite ignore SIGTERM, so kill soon
                context.close(timeout=PEER_FAILURE_GRACE_S)
                return LaunchResult(1, f"{peer}; this node's roles were stopped")
        if _workers_succeeded(context, roles):
            workers_done_at = workers_done_at or time.monotonic()
            if time.monotonic() - workers_done_at > SHUTDOWN_GRACE_S:
                print(f"dprorun: every worker finished; the scheduler and servers had not after "
                      f"{SHUTDOWN_GRACE_S:g} s and were stopped", file=sys.stderr, flush=True)
                context.close()
                return None


def _kvstore_rank_of(run_dir: str, launch_index: int) -> Optional[int]:
    """The kvstore rank of the worker launched `launch_index`-th, where the hooks found it numbered otherwise (the
    scheduler numbers workers as they register); None where it is the same or unknown (another host's worker)."""
    from dprorun.layout import MX_LAUNCH_INDEX_FILE, rank_folders

    for rank, folder in rank_folders(run_dir).items():
        try:
            with open(os.path.join(folder, MX_LAUNCH_INDEX_FILE)) as handle:
                if int(handle.read().strip()) == launch_index:
                    return rank
        except (OSError, ValueError):
            continue
    return None


def _failed_role(result, roles: list[tuple[str, int]], run_dir: str) -> LaunchResult:
    """The role that failed first named, with its exit code or signal; every role's failure in the details."""
    def order(item):
        """A role whose script raised (an exit code and its error) first: the launcher then stops the others,
        SIGKILLing those that ignore SIGTERM, so a kill is no evidence of a cause; then a role killed by a signal
        other than SIGTERM (a server killed from outside), then any other exit code, then the stopped ones; within
        each, the earliest."""
        slot, failure = item
        code = failure.exitcode
        stopped = code in (-signal.SIGTERM, 128 + signal.SIGTERM)  # 143: a worker's SIGTERM watcher (bootstrap.py)
        rank = 0 if code > 0 and error_message(failure) else 1 if code < 0 and not stopped else \
            2 if not stopped else 3
        return (rank, failure.timestamp, slot)

    slot, failure = min(result.failures.items(), key=order)
    role, index = roles[slot]
    name = "the scheduler" if role == "scheduler" else f"{role} {index}"
    kvstore_rank = _kvstore_rank_of(run_dir, index) if role == "worker" else None
    if kvstore_rank is not None:
        name += f" (the kvstore's worker {kvstore_rank}: its traces are rank_{kvstore_rank})"
    code = failure.exitcode
    how = f"was killed by signal {signal_name(-code)}" if code < 0 else f"exited with code {code}"
    detail = error_message(failure) or (
        last_words(os.path.join(run_dir, "logs"), slot) if 0 < code != 128 + signal.SIGTERM else "")
    message = f"{name} (pid {failure.pid}) {how}" + (f": {detail}" if detail else "")
    message += "; every other role was stopped"
    return LaunchResult(128 - code if code < 0 else (code or 1), message, None,
                        {f"{roles[s][0]}{roles[s][1]}": {"exitcode": f.exitcode, "pid": f.pid}
                         for s, f in result.failures.items()})
