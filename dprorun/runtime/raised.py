"""A rank whose script raised: the exception noted in its records ("training script raised ...", which the launcher
and the summary name) and written to torch elastic's error file; an MXNet worker leaves at once.

The rank's own sys.excepthook does this as the exception is printed. A script that installs an excepthook of its own
afterwards (`rich.traceback.install()`, a logger's) replaced it: the failing rank was named without its error
(an MXNet worker: "killed by signal SIGABRT" in MXNet's exit, the ValueError it raised said nowhere). Python keeps
the uncaught exception it printed in sys.last_value whichever hook printed it; at exit, an exception no hook of
ours noted is noted from there (`note_uncaught_at_exit`: an exit handler of the rank's, and, in an MXNet worker,
the one that runs before MXNet's own).
"""
from __future__ import annotations

import os
import sys

ERROR_FILE_HINT = "dprorun_hint"  # the key of the launch hint in an error file's extraInfo (procs.error_hint)


def exception_line(exc: BaseException) -> str:
    """"Type: message" as Python's last traceback line says it: the type alone where the message is empty (a bare
    KeyboardInterrupt read "KeyboardInterrupt:")."""
    said = str(exc)
    return f"{type(exc).__name__}: {said}" if said else type(exc).__name__


def note_script_raised(session, exc: BaseException, tb=None) -> bool:
    """Note the script's uncaught exception once (False where it already was, or in a process forked from the
    rank, whose error file is not its own)."""
    from dprorun.layout import SCRIPT_RAISED

    if os.getpid() != session.pid:
        return False
    if any(isinstance(w, str) and w.startswith(SCRIPT_RAISED) for w in session.records.warnings):
        return False
    try:
        session.records.warnings.append(f"{SCRIPT_RAISED}{exception_line(exc)}")
        write_torchelastic_error(exc, tb, _launch_hint(session))
    except Exception:  # noting must never hide the script's own error
        pass
    return True


def _launch_hint(session) -> str:
    """How the job should have been launched, where the rank loaded another framework's distributed API and never
    used torch.distributed (an MXNet kvstore without its roles: "Check notnull ... DMLC_NUM_WORKER", said alone)."""
    from dprorun.runtime.watch import launch_hint

    use = getattr(session, "script_use", None)
    return launch_hint(use, failed=True) if use is not None else ""


def note_uncaught_at_exit(session) -> bool:
    """At exit: the exception Python printed last (sys.last_value), where no hook of ours saw it, noted; True
    where the script raised (whoever noted it)."""
    exc = getattr(sys, "last_value", None)
    if exc is None or isinstance(exc, SystemExit) or os.getpid() != session.pid:
        return note_script_exit(session)
    note_script_raised(session, exc, getattr(sys, "last_traceback", None))
    return True


def leave_an_mxnet_worker_that_raised(session, code: int = 1) -> None:
    """An MXNet worker that raised never exits by itself: its kvstore's shutdown waits for the other workers at a
    barrier they will not reach, and the job hangs (or MXNet's exit aborts it). Keep what was recorded, then
    leave now, so the launcher sees the failure, with its cause, and stops every role."""
    try:
        sys.stderr.flush()
        session.at_exit()
    finally:
        os._exit(code)


class _CaughtExit:
    """Rides on the SystemExit that the script's sys.exit raises. Freed while Python code runs (the script
    caught the SystemExit and went on), it takes the noted status back; freed by the interpreter's own handling of
    an uncaught SystemExit, just before the exit handlers run, no Python frame is running and the status stays."""

    def __init__(self, session):
        self.session = session

    def __del__(self):
        try:
            sys._getframe(1)
        except ValueError:  # the interpreter's exit: the script left through this SystemExit
            return
        self.session.script_exit_status = None


def watch_sys_exit(session) -> None:
    """What the script's main thread passes to sys.exit, kept on the session
    (`script_exit_status`) while the SystemExit is on its way out (`_CaughtExit`; the next iteration also clears
    it). `sys.exit("dataset shard 1 is empty")` reaches no excepthook: the rank was named without its cause, and an
    MXNet worker waited in the kvstore's closing barrier for workers still training (the job hung, under plain
    MXNet too)."""
    import functools
    import threading

    original = sys.exit

    @functools.wraps(original)
    def exit_noted(status=None):
        if os.getpid() != session.pid or threading.current_thread() is not threading.main_thread():
            original(status)
        session.script_exit_status = status
        try:
            original(status)
        except SystemExit as leaving:
            leaving._dpro_caught_exit = _CaughtExit(session)
            raise

    sys.exit = exit_noted
    import builtins

    for name in ("exit", "quit"):  # site's Quitter objects, `exit("message")` in a script: the same SystemExit
        quitter = getattr(builtins, name, None)
        if quitter is not None and not isinstance(quitter, _NotedQuitter):
            setattr(builtins, name, _NotedQuitter(quitter, exit_noted))


class _NotedQuitter:
    """builtins.exit / quit as site made them (stdin closed, then SystemExit), through `watch_sys_exit`'s sys.exit;
    printed as the original is."""

    def __init__(self, quitter, exit_noted):
        self.quitter, self.exit_noted = quitter, exit_noted

    def __repr__(self):
        return repr(self.quitter)

    def __call__(self, code=None):
        try:
            sys.stdin.close()
        except Exception:
            pass
        self.exit_noted(code)


def note_script_exit(session) -> bool:
    """At exit: a script that left through `sys.exit("message")` (`watch_sys_exit`) noted as "SystemExit: message",
    in its records and torch elastic's error file, as a raise would be (the launchers name the rank with it; under
    horovodrun, from the records). An exit code alone is not noted: the launchers quote the rank's last stderr
    line (argparse's error before its sys.exit(2))."""
    status = getattr(session, "script_exit_status", None)
    if status is None or isinstance(status, int) or os.getpid() != session.pid:
        return False
    note_script_raised(session, SystemExit(status))
    return True


def leave_an_mxnet_worker_that_exited_failing(session) -> None:
    """At exit (before MXNet's own handler): a worker whose script called sys.exit with a non-zero code leaves at
    once with that code (with a message: `note_uncaught_at_exit` noted it and the worker left with 1)."""
    status = getattr(session, "script_exit_status", None)
    if isinstance(status, int) and status != 0:
        leave_an_mxnet_worker_that_raised(session, status & 0xFF or 1)


def write_torchelastic_error(exc: BaseException, tb=None, hint: str = "") -> None:
    """Per-rank error file in torchelastic's format, so the launcher names the failing rank and its error. Written
    here, not through torch's ErrorHandler: its record_exception reads the traceback from sys.exc_info(), which an
    excepthook does not have (the file's stack said "NoneType: None"), and its initialize() enables faulthandler on
    the rank's stderr (a warning, "Unable to enable fault handler", under a script whose main() is @record's)."""
    import traceback

    if not _error_file():
        return
    stack = "".join(traceback.format_exception(type(exc), exc, tb))
    message = exception_line(exc)
    if type(exc).__module__ == "torch.multiprocessing.spawn" and hasattr(exc, "error_index"):
        # a process the script spawned failed (its traceback in the message): named, with its error's last line
        said = [line.strip() for line in str(exc).splitlines() if line.strip()]
        message = f"the script's spawned process {exc.error_index} (pid {getattr(exc, 'error_pid', '?')}) failed: " \
                  f"{said[-1] if said else type(exc).__name__}"
    write_torchelastic_error_message(message, stack, hint)


def _error_file() -> str:
    """torch elastic's per-rank error file, where its agent set one; a horovodrun rank's in the run directory."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE", "")
    if not path and "HOROVOD_RANK" in os.environ and os.environ.get("DPRO_RUN_DIR"):
        from dprorun.layout import horovod_error_file

        path = horovod_error_file(os.environ["DPRO_RUN_DIR"], int(os.environ["HOROVOD_RANK"]))
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    return path


def write_torchelastic_error_message(message: str, stack: str = "", hint: str = "") -> None:
    """torch elastic's error file (TORCHELASTIC_ERROR_FILE, where the launcher set one; a horovodrun rank's,
    layout.horovod_error_file) with this message; a hint of dprorun's for the launcher in its extra info."""
    import time

    path = _error_file()
    if not path:
        return
    extra = {"py_callstack": stack, "timestamp": str(int(time.time()))}
    if hint:
        extra[ERROR_FILE_HINT] = hint
    from dprorun.fsutil import atomic_write_json

    # whole or not at all: a rank stopped while writing left it empty, and the agent's read of it failed ("Expecting
    # value", the launcher's "error file could not be read (empty ...)"; once in a restarts test of the suite)
    atomic_write_json(path, {"message": {"message": message, "extraInfo": extra}})
