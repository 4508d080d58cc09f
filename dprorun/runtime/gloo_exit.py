"""A rank's exit that gloo's worker threads do not abort.

Each gloo process group runs its collectives on worker threads ("pt_gloo_runloop"). A worker drops its reference to
a finished collective's work object just after completing it; where that reference is the last (the script let go
of the work, as DDP's reducer does), the work's thread-local state is freed on the worker, which takes the GIL to
release the Python objects in it. A rank that ends right after its last collective (the group still held by a model
at exit, as most scripts leave it) can reach interpreter finalization before a descheduled worker has dropped it:
the GIL is gone, the worker's thread exits inside a C++ destructor, and the rank dies by SIGABRT ("terminate called
without an active exception") after its work is done. Measured with a 2-rank DDP script on 2 busy cores: 6 of 40
plain torchrun launches aborted so, 0 of 40 with `wait_for_idle_gloo_workers` run at exit.

At exit (an atexit handler, before finalization, the GIL held) the rank waits, bounded, until every gloo worker
thread of the process is asleep: a worker asleep has dropped the work it last ran (or waits inside one the script
never waited for, which no wait here can end)."""
from __future__ import annotations

import os
import sys
import time
from typing import Optional

GLOO_WORKER_THREAD = "pt_gloo_runloop"  # the name torch gives ProcessGroupGloo's worker threads
IDLE_WAIT_S = 2.0  # at most this long at exit; DPRO_GLOO_EXIT_WAIT_S sets it (0: no wait)
ASLEEP = ("S", "D")  # /proc states of a thread that is not running nor ready to run


def gloo_worker_states(task_dir: str = "/proc/self/task") -> list[str]:
    """The scheduler state (/proc's one letter: R running or ready, S asleep, ...) of each gloo worker thread of
    this process; empty where there is none or /proc cannot be read."""
    states = []
    try:
        tasks = os.listdir(task_dir)
    except OSError:
        return states
    for tid in tasks:
        try:
            with open(os.path.join(task_dir, tid, "comm")) as handle:
                if handle.read().strip() != GLOO_WORKER_THREAD:
                    continue
            with open(os.path.join(task_dir, tid, "stat")) as handle:
                states.append(handle.read().rsplit(")", 1)[1].split()[0])
        except (OSError, IndexError):  # the thread ended meanwhile
            continue
    return states


def wait_s_from_env(variable: str, default: float) -> float:
    """Seconds to wait, from the environment variable `variable` (0: no wait), else `default`."""
    try:
        return max(0.0, float(os.environ.get(variable, default)))
    except ValueError:
        return default


def exit_wait_s() -> float:
    return wait_s_from_env("DPRO_GLOO_EXIT_WAIT_S", IDLE_WAIT_S)


def wait_for_idle_gloo_workers(timeout_s: Optional[float] = None,
                               task_dir: str = "/proc/self/task") -> Optional[float]:
    """Wait until every gloo worker thread is seen asleep twice in a row, 1 ms apart, at most `timeout_s` (default
    exit_wait_s()). Returns the seconds waited, None where it timed out. Only in a process that loaded
    torch.distributed."""
    timeout_s = exit_wait_s() if timeout_s is None else timeout_s
    if "torch.distributed" not in sys.modules or timeout_s <= 0:
        return 0.0
    start = time.monotonic()
    asleep_in_a_row = 0
    while time.monotonic() - start < timeout_s:
        states = gloo_worker_states(task_dir)
        asleep_in_a_row = asleep_in_a_row + 1 if all(state in ASLEEP for state in states) else 0
        if asleep_in_a_row >= 2:
            return time.monotonic() - start
        time.sleep(0.001)
    return None
