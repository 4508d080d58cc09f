"""Process-management helpers every launch path shares (elastic ranks, engine CLIs, parameter-server roles): the
launch's result, the ranks' environment (hooks on PYTHONPATH, DPRO_* settings), free ports, the training command
split into executable and arguments, the --timeout watchdog, an engine CLI run with signals forwarded to it, and the
wording of signals and error files."""
from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

from dprorun.config import JobConfig
from dprorun.layout import TF_WORKERS_ENV, TF_XLA_AUTO_JIT

PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE_DIR = os.path.join(PACKAGE_ROOT, "dprorun")
PACKAGE_DIR_ENV = "DPRO_PACKAGE_DIR"  # where the hooks' sitecustomize imports dprorun from in every rank


@dataclass
class LaunchResult:
    exit_code: int
    message: str = ""
    failed_rank: Optional[int] = None
    failures: dict = field(default_factory=dict)
    elapsed_s: float = 0.0
    relaunches: list[str] = field(default_factory=list)  # why the job was launched again (launch.launch)


def hooks_dir() -> str:
    """The folder holding the bootstrap sitecustomize.py (source tree, or installed data files: under the
    environment's prefix, or the user's base for `pip install --user`)."""
    import site

    candidates = [os.path.join(PACKAGE_ROOT, "hooks"),
                  os.path.join(sys.prefix, "share", "dprorun", "hooks"),
                  os.path.join(site.getuserbase(), "share", "dprorun", "hooks")]
    for candidate in candidates:
        if os.path.isfile(os.path.join(candidate, "sitecustomize.py")):
            return candidate
    raise FileNotFoundError("dprorun's hooks/sitecustomize.py was not found (looked in "
                            + ", ".join(candidates) + ")")


def free_port(addr: str = "127.0.0.1", count: int = 1) -> int:
    """A port free on addr now, with the count - 1 ports after it. Drawn below the kernel's ephemeral range: a port
    from bind(addr, 0) comes from that range, which the kernel also hands to every outgoing connection and to the
    next bind(0), so another process could take it before the job binds it (a suite run lost a test so, the nodes'
    link on master port + 1 taken). Falls back to bind(0) when no port below the range is free."""
    low = _ephemeral_ports()[0]
    draw = random.SystemRandom()
    first, last = max(1024, low - 20000), low - count
    for _ in range(100 if last > first else 0):
        port = draw.randrange(first, last)
        if all(_bindable(addr, candidate) for candidate in range(port, port + count)):
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((addr, 0))
        return sock.getsockname()[1]


def _ephemeral_ports() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as handle:
            low, high = (int(value) for value in handle.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _bindable(addr: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((addr, port))
        except OSError:
            return False
    return True


def rank_environment(job: JobConfig) -> dict[str, str]:
    """Variables every rank inherits: hooks on PYTHONPATH, dprorun importable, profiling settings.

    Only the hooks' folder goes on PYTHONPATH: the folder holding dprorun is a source tree's root (its examples/,
    scripts/ and tests/ would join a script's own namespace packages of those names) or an environment's
    site-packages (whose numpy 2 an MXNet job's own environment then imported in place of its numpy 1.23). The
    hooks import dprorun alone from DPRO_PACKAGE_DIR."""
    existing = os.environ.get("PYTHONPATH", "")
    env = {"PYTHONPATH": os.pathsep.join([hooks_dir()] + ([existing] if existing else [])),
           PACKAGE_DIR_ENV: PACKAGE_DIR}
    env.update(job.profile.to_env())
    env["DPRO_STRATEGY"] = os.path.abspath(job.strategy_file) if job.strategy_file else ""
    env["DPRO_BACKEND"] = job.launch.backend
    if job.launch.backend == "tf":
        env[TF_WORKERS_ENV] = ",".join(tf_worker_addresses(job))
        if job.strategy_file:
            from dprorun.strategy import load_strategy

            if load_strategy(job.strategy_file).tf_xla:  # before TensorFlow initialises in the workers
                env["TF_XLA_FLAGS"] = (os.environ.get("TF_XLA_FLAGS", "") + " " + TF_XLA_AUTO_JIT).strip()
    if job.low_disk:
        env["DPRO_ENABLED"] = "0"  # no hooks: nothing of ours competes with the job for the disk
    env.setdefault("KINETO_LOG_LEVEL", os.environ.get("KINETO_LOG_LEVEL", "6"))  # no profiler chatter per rank
    # Kineto leaves CUPTI subscribed after the profiler stops unless told to tear it down; on GPU that kept every
    # kernel launch slower for the rest of the job (benchmarks/gpu_overhead.py). A user's own setting wins.
    env.setdefault("TEARDOWN_CUPTI", os.environ.get("TEARDOWN_CUPTI", "1"))
    if "OMP_NUM_THREADS" not in os.environ and job.launch.nproc_per_node > 1 and job.launch.backend not in (
            "horovod", "tf", "mxnet"):
        env["OMP_NUM_THREADS"] = "1"  # as torchrun does (horovodrun does not: its jobs keep their threads)
    return env


TF_BASE_PORT_ENV = "DPRO_TF_BASE_PORT"  # multi-host TF: worker k of a host listens on base + k (default 29600)


def tf_worker_addresses(job: JobConfig) -> list[str]:
    """Every TF worker's host:port in rank order: free loopback ports on one host; across --hosts, port
    DPRO_TF_BASE_PORT (29600) + local rank on each host, so every node computes the same list."""
    if job.launch.nnodes == 1 and not job.launch.hosts:
        base = free_port(count=job.launch.nproc_per_node)
        return [f"127.0.0.1:{base + rank}" for rank in range(job.launch.nproc_per_node)]
    if not job.launch.hosts:
        raise ValueError("--backend tf across several nodes needs --hosts (each worker's address goes into every "
                         "worker's TF_CONFIG)")
    base = int(os.environ.get(TF_BASE_PORT_ENV, "29600"))
    return [f"{host}:{base + k}" for host in job.launch.hosts for k in range(job.launch.nproc_per_node)]


PYTHON_FLAGS_WITHOUT_THE_HOOKS = {"E": "ignores PYTHONPATH", "I": "isolated: ignores PYTHONPATH",
                                  "S": "imports no site, hence no sitecustomize"}


def python_flag_without_the_hooks(command: list[str]) -> str:
    """The interpreter flag of `python -E|-I|-S ... train.py` that keeps dprorun's hooks out of every rank (they load
    as a sitecustomize on PYTHONPATH), with why (e.g. "-E (ignores PYTHONPATH)"); "" where there is none."""
    if not command or not os.path.basename(command[0]).startswith("python"):
        return ""
    words = iter(command[1:])
    for word in words:
        if word in ("-W", "-X", "--check-hash-based-pycs"):
            next(words, None)
        elif not word.startswith("-") or word in ("-", "--") or word.startswith(("-m", "-c", "--")):
            return ""
        else:
            for letter in word[1:]:
                if letter in PYTHON_FLAGS_WITHOUT_THE_HOOKS:
                    return f"-{letter} ({PYTHON_FLAGS_WITHOUT_THE_HOOKS[letter]})"
                if letter in "WX":  # -Werror, -Xdev: the rest of the word is the option's value
                    break
    return ""


def split_command(command: list[str]) -> tuple[str, list[str]]:
    """('python', ['train.py', ...]) -> the executable and its arguments; a bare script runs with this Python."""
    if not command:
        raise ValueError("no training command given (e.g. dprorun -np 2 python train.py)")
    head = command[0]
    if head.endswith(".py"):
        return sys.executable, ["-u"] + command
    exe = shutil.which(head)
    if exe is None:
        raise ValueError(f"training command not found: {head!r}")
    if os.path.basename(head).startswith("python"):
        return exe, ["-u"] + command[1:]
    return exe, command[1:]


PYTHON_OPTIONS_TAKING_A_VALUE = ("-W", "-X", "--check-hash-based-pycs")


def python_script_word(python_args: list[str]) -> Optional[str]:
    """What Python runs given these arguments: the script's path, "-c" or "-m", "-" (standard input), or None
    (no script: the interactive interpreter, which also reads standard input)."""
    index = 0
    while index < len(python_args):
        word = python_args[index]
        if word in ("-c", "-m", "-") or not word.startswith("-"):
            return word
        index += 2 if word in PYTHON_OPTIONS_TAKING_A_VALUE else 1
    return None


def refuse_script_from_stdin(command: list[str], processes_here: int) -> None:
    """`dprorun -np 2 python - < train.py`: every rank inherits the one standard input and reads part of the
    script (a SyntaxError in each), or one reads all of it and the others an empty script, which ends at once while
    the first waits for them in its rendezvous until the timeout (a hang). Refused before anything starts."""
    head = command[0] if command else ""
    if processes_here < 2 or head.endswith(".py") or not os.path.basename(head).startswith("python"):
        return
    word = python_script_word(command[1:])
    if word is None or word == "-":
        raise ValueError(f"the command reads its script from standard input ({' '.join(command)[:80]}), which the "
                         f"{processes_here} processes on this host would share, each reading a part of it: give "
                         "the script as a file (dprorun -np 2 python train.py)")


# a pipe whose reader left (`| head`), a terminal hung up (an ssh session lost: SIGHUP, then every write fails EIO)
GONE_READER_ERRNOS = (errno.EPIPE, errno.EIO)


class StdoutThatOutlivesItsReader:
    """dprorun's standard output (and error), kept writable when its reader leaves (`dprorun ... | head`, or a
    terminal that hung up, where after SIGHUP the first print failed with EIO: exit 1, no summary.json): the write
    that meets the closed pipe, and every one after it, goes to /dev/null. Before, the first print after the reader
    left raised BrokenPipeError: torch elastic's log tailers printed a traceback per rank, and the summary's print
    ended dprorun in a traceback, exit 1, after a job that had completed. A character the stream's encoding cannot
    hold (an ASCII or Latin-1 console: PYTHONIOENCODING, a locale that is not UTF-8) is replaced, where the summary's
    first "→" ended dprorun with exit 2 after a completed job. Everything else is the stream's own."""

    def __init__(self, stream):
        self._stream = stream
        encoding = (getattr(stream, "encoding", None) or "").lower().replace("-", "").replace("_", "")
        if encoding != "utf8" and hasattr(stream, "reconfigure"):
            try:
                stream.reconfigure(errors="replace")
            except (ValueError, OSError):  # a stream that cannot be reconfigured now: left as it is
                pass

    def _closed_reader(self) -> None:
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())  # the stream's buffered bytes flush into nothing at exit
            os.close(devnull)
        except (OSError, ValueError):
            pass

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as exc:
            if exc.errno not in GONE_READER_ERRNOS:
                raise
            self._closed_reader()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as exc:
            if exc.errno not in GONE_READER_ERRNOS:
                raise
            self._closed_reader()

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def stop_process_tree(pid: int, grace_s: float = 5.0) -> None:
    """SIGTERM to a process and every process under it, SIGKILL to those still there after grace_s."""
    import psutil

    try:
        root = psutil.Process(pid)
        tree = root.children(recursive=True) + [root]
    except psutil.NoSuchProcess:
        return
    for process in tree:
        with contextlib.suppress(psutil.Error):
            process.terminate()
    _, alive = psutil.wait_procs(tree, timeout=grace_s)
    for process in alive:
        with contextlib.suppress(psutil.Error):
            process.kill()


class Watchdog:
    """Sends SIGTERM to this process after the job's --timeout; the elastic agent then stops all ranks."""

    def __init__(self, timeout_s: Optional[float]):
        self.fired = False
        self._timer = None
        if timeout_s:
            self._timer = threading.Timer(timeout_s, self._fire)
            self._timer.daemon = True

    def _fire(self) -> None:
        self.fired = True
        os.kill(os.getpid(), signal.SIGTERM)

    def __enter__(self):
        if self._timer:
            self._timer.start()
        return self

    def __exit__(self, *exc):
        if self._timer:
            self._timer.cancel()


def error_message(failure) -> str:
    """The failing rank's error, one line, from torch elastic's failure record (its error file's message)."""
    try:
        message = failure.message
    except Exception:
        return ""
    if isinstance(message, dict):
        message = message.get("message", "")
    text = str(message or "").strip()
    if not text or text.startswith("To enable traceback") or text == "<N/A>":
        return ""
    return cause_line(text)[:300]


def error_hint(failure) -> str:
    """What the failing rank's hooks added to its error file for the launcher (runtime/raised.py: the launch that
    fits the frameworks it loaded), "" where nothing."""
    from dprorun.runtime.raised import ERROR_FILE_HINT

    message = getattr(failure, "message", None)
    extra = message.get("extraInfo") if isinstance(message, dict) else None
    hint = extra.get(ERROR_FILE_HINT) if isinstance(extra, dict) else None
    return hint if isinstance(hint, str) else ""


# the signals torch elastic's process context takes over in the launcher (its default TORCHELASTIC_SIGNALS_TO_HANDLE)
ENGINE_HANDLED_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")


@contextlib.contextmanager
def launcher_signal_handlers_restored():
    """The launcher's signal handlers as they were before a launch: torch elastic's process context replaces them
    with its own, which raises SignalException (an Exception) and stays after the launch, so that a Ctrl-C during
    the job-end analysis was caught as an analysis failure ("clock alignment failed: Process N got signal: 2") and
    the command went on to exit 0."""
    names = {*ENGINE_HANDLED_SIGNALS, *os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE", "").split(",")}
    signums = {getattr(signal, name.strip()) for name in names if hasattr(signal, name.strip())}
    saved = {signum: signal.getsignal(signum) for signum in signums}
    try:
        yield
    finally:
        for signum, handler in saved.items():
            if handler is not None:
                try:
                    signal.signal(signum, handler)
                except ValueError:  # not the main thread: nothing was replaced there either
                    pass


@dataclass
class FailedAttempt:
    """An attempt of a job that torch elastic restarted (--max-restarts): which, and what its ranks' error files say."""

    attempt: int
    cause: str  # "rank R (local rank L): <the error's line>", or why none was recorded


def failed_attempts(run_log_dir: Optional[str], first_rank: int, consequential: tuple[str, ...],
                    first_failures: Optional[list[tuple[int, int]]] = None) -> list[FailedAttempt]:
    """The attempts before the last in torch elastic's log folder of one launch (`<run>/attempt_<n>/`), each with
    its cause: a rank a signal killed first (`first_failures`: the agent's (exit code, local rank) of each failed
    attempt's first failure; the OOM killer's SIGKILL leaves no error file), else what its ranks' error files say
    (`<local_rank>/error.json`, written where a rank raised): an error of the rank's own before one that says a
    peer failed first (`consequential`), the earliest within each; else the first failure's exit code."""
    if not run_log_dir or not os.path.isdir(run_log_dir):
        return []
    attempts = sorted(int(name[8:]) for name in os.listdir(run_log_dir)
                      if name.startswith("attempt_") and name[8:].isdigit())
    found = []
    for attempt in attempts[:-1]:
        errors = []
        folder = os.path.join(run_log_dir, f"attempt_{attempt}")
        for name in [name for name in os.listdir(folder) if name.isdigit()]:
            try:
                with open(os.path.join(folder, name, "error.json"), encoding="utf-8") as handle:
                    record = json.load(handle).get("message", {})
            except (OSError, ValueError, AttributeError):
                continue
            text = record.get("message", "") if isinstance(record, dict) else str(record)
            stamp = (record.get("extraInfo") or {}).get("timestamp", "0") if isinstance(record, dict) else "0"
            errors.append((any(mark in text for mark in consequential), int(stamp or 0), int(name), cause_line(text)))
        code, first_local = first_failures[attempt] if attempt < len(first_failures or ()) else (None, None)
        if code is not None and code < 0 and -code != signal.SIGTERM:
            cause = f"rank {first_rank + first_local} (local rank {first_local}) was killed by signal " \
                    f"{signal_name(-code)}"
        elif errors:
            peer_first, _, local_rank, line = min(errors)
            cause = f"rank {first_rank + local_rank} (local rank {local_rank}): {line[:300]}"
            if peer_first:  # every error here says a peer failed first: on another node, or killed
                cause = f"a rank elsewhere failed first ({cause})"
        elif code is not None:
            cause = f"rank {first_rank + first_local} (local rank {first_local}) exited with code {code}, no error " \
                    f"recorded; its logs: {folder}"
        else:
            cause = f"no rank recorded an error (killed by a signal?); its logs: {folder}"
        found.append(FailedAttempt(attempt, cause))
    return found


TF_NODE_NOTE = "[[{{node"  # the line TensorFlow ends an op's error with, after the cause


def cause_line(error: str) -> str:
    """An exception "Type: message" as one line: its first, unless that line heads what follows: a library's own
    traceback in the message (MXNetError's "Traceback (most recent call last):": its last line says what failed), or
    a header ending with ":" (TensorFlow's "UnimplementedError: Graph execution error:", then where, then the cause,
    then the node's note), where the last line is the cause, given the header's type."""
    lines = [line.strip() for line in error.splitlines() if line.strip()]
    if not lines:
        return ""
    said = [line for line in lines[1:] if not line.startswith(TF_NODE_NOTE)]
    if lines[0].endswith("Traceback (most recent call last):") and said:
        return said[-1]
    if lines[0].endswith(":") and said:
        kind = lines[0].split(": ", 1)[0] if ": " in lines[0] else ""
        return said[-1] if not kind or said[-1].startswith(kind + ":") else f"{kind}: {said[-1]}"
    return lines[0]


def error_line(error: str) -> str:
    """An exception as one line (`cause_line`), as the launcher's failure message says it."""
    return cause_line(error)[:200]


CXX_TERMINATE = "terminate called without an active exception"


def _stderr_tail(log_dir: str, local_rank: int) -> str:
    """The last 8 KiB of a rank's stderr log in torch elastic's log folder
    (`<log_dir>/<run>/attempt_<n>/<local_rank>/stderr.log`; this launch's: an autotune run holds several); empty
    where it is not there (the ranks' output was not kept)."""
    import glob

    logs = glob.glob(os.path.join(glob.escape(log_dir), "*", "attempt_*", str(local_rank), "stderr.log"))
    try:
        if not logs:
            return ""
        path = max(logs, key=os.path.getmtime)
        with open(path, "rb") as handle:
            handle.seek(max(0, os.path.getsize(path) - 8192))
            return handle.read().decode("utf-8", "replace")
    except OSError:
        return ""


def exit_abort_hint(log_dir: str, local_rank: int) -> str:
    """Why a rank that aborted (SIGABRT) most likely did, read off the end of its stderr log: a C++ thread that was
    still running when the interpreter shut down (in torch jobs: a process group's worker thread, the group kept
    alive past the script's end). Empty when the log does not say so or is not there."""
    if CXX_TERMINATE not in _stderr_tail(log_dir, local_rank):
        return ""
    return (f"its log's last lines say '{CXX_TERMINATE}': a C++ thread was still running as the process exited. In "
            "a torch job that is usually a process group's worker thread, the group still alive (a model that holds "
            "it, or no dist.destroy_process_group()); the job aborts the same way under torchrun, though less often "
            "under dprorun, whose ranks wait at exit until gloo's threads are asleep (DPRO_GLOO_EXIT_WAIT_S, 2 s). "
            "Destroy the group at the end, after dropping what holds it")


def last_words(log_dir: str, local_rank: int) -> str:
    """"its last line on stderr: ..." for a rank that exited with a code and no recorded error: what `raise
    SystemExit("...")` or argparse's `parser.error` print as the process leaves (no exception reaches a hook, so no
    error file names it); "" where it wrote none. dprorun's own lines and torch's logging lines (W/I/E1206
    12:00:00...) are passed over."""
    for line in reversed(_stderr_tail(log_dir, local_rank).splitlines()):
        line = line.strip()
        if line and not line.startswith("[dprorun") and not re.match(r"[WIEF]\d{4} \d\d:\d\d:\d\d", line):
            return f"its last line on stderr: {line[:300]}"
    return ""


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def call_forwarding_signals(cmd: list[str], env: dict[str, str], timeout_s: Optional[float] = None,
                            stdout_to_stderr: bool = False) -> tuple[int, Optional[int], bool]:
    """Run an engine's CLI as a child, in a process group of its own (`engine_apart_from_dprorun_s_group`);
    SIGINT/SIGTERM sent to dprorun go to it (it stops its ranks), SIGHUP (the terminal hung up) as SIGTERM (before,
    dprorun died of it at once: no word, no analysis), SIGTSTP and SIGCONT (Ctrl-Z, `fg`) as they are;
    `timeout_s` stops it; `stdout_to_stderr` (`--json`): its output, the ranks' with it, goes to stderr. Returns
    (exit code, the signal forwarded or None, whether the timeout fired)."""
    if stdout_to_stderr:
        sys.stdout.flush()
    proc = subprocess.Popen(cmd, env=env, stdout=sys.stderr.fileno() if stdout_to_stderr else None,
                            preexec_fn=engine_apart_from_dprorun_s_group())
    forwarded = {}

    def forward(signum, frame):
        forwarded.setdefault("signal", signum)
        forwarded.setdefault("at", time.monotonic())
        sent = signal.SIGTERM if signum == signal.SIGHUP else signum
        try:  # to its group, as a terminal's Ctrl-C reaches a plain launch (bpslaunch's workers are in its group)
            os.killpg(proc.pid, sent)
        except (ProcessLookupError, PermissionError):
            proc.send_signal(sent)

    def to_the_engine(signum: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signum)

    def suspend(signum, frame):  # a terminal's Ctrl-Z: the engine stops with dprorun, as when they shared the group
        to_the_engine(signal.SIGTSTP)
        os.kill(os.getpid(), signal.SIGSTOP)

    # a signal dprorun was started ignoring (`nohup`: SIGHUP) stays ignored, as the engine inherits it: `nohup
    # horovodrun` outlives a hang-up, and `nohup dprorun --backend horovod` had forwarded it as SIGTERM
    handlers = {signal.SIGINT: forward, signal.SIGTERM: forward, signal.SIGHUP: forward, signal.SIGTSTP: suspend,
                signal.SIGCONT: lambda signum, frame: to_the_engine(signal.SIGCONT)}
    previous = {s: signal.signal(s, handler) for s, handler in handlers.items()
                if signal.getsignal(s) is not signal.SIG_IGN}
    try:
        with Watchdog(timeout_s) as watchdog:
            code = _wait_stopping_a_deaf_engine(proc, forwarded, os.path.basename(cmd[0]))
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return code, forwarded.get("signal"), watchdog.fired


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def engine_apart_from_dprorun_s_group():
    """What an engine's CLI runs before its command (Popen's preexec_fn): a process group of its own, and SIGTERM
    when dprorun dies. The engines put their ranks in sessions of their own and stop them when signalled; in
    dprorun's group, a signal to the group (a terminal's Ctrl-C, `kill -TERM -PGID`) reached the engine twice, the
    group's and dprorun's forwarded one, and horovodrun, whose handler sets a threading.Event, deadlocked in its
    handler run again inside the first (1 in 5 launches here; its ranks trained on until dprorun's 15 s escalation).
    Now dprorun's is the one signal it gets, sent to the engine's group (an engine whose workers stay in its group,
    as bpslaunch's, has them signalled as from a terminal). Its death signal: dprorun killed with its group (SIGKILL
    included) still stops the engine, as when they shared the group (Linux; elsewhere the group alone)."""
    parent = os.getpid()
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: nothing to import after the fork
    except (OSError, AttributeError, ImportError):
        prctl = None

    def in_the_child() -> None:
        os.setpgid(0, 0)
        if prctl is not None:
            prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
            if os.getppid() != parent:  # dprorun died before the death signal was set
                os.kill(os.getpid(), signal.SIGTERM)

    return in_the_child


ENGINE_STOP_GRACE_S = 15.0  # an engine that has not stopped this long after a forwarded signal: its tree stopped


def _wait_stopping_a_deaf_engine(proc: subprocess.Popen, forwarded: dict, name: str) -> int:
    """The engine's exit code. horovodrun takes neither SIGTERM nor SIGINT while its ranks run (a rank stuck in an
    all-reduce kept dprorun, its --timeout included, waiting for good): ENGINE_STOP_GRACE_S after the first
    forwarded signal, the engine and every process under it are stopped (SIGTERM, then SIGKILL)."""
    stopped = False
    while True:
        try:
            return proc.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            at = forwarded.get("at")
            if stopped or at is None or time.monotonic() - at < ENGINE_STOP_GRACE_S:
                continue
            stopped = True
            print(f"dprorun: {name} had not stopped {ENGINE_STOP_GRACE_S:.0f} s after "
                  f"{signal.Signals(forwarded['signal']).name}: stopping it and its ranks", file=sys.stderr, flush=True)
            stop_process_tree(proc.pid)
