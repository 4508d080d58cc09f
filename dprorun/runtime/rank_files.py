"""The files one rank writes into its directory of the run: events.json (its records and window), samples.json
(the samplers), clean.json (the start times of the iterations run without profiling), with the memory figures
taken at the end of the window."""
from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Optional

from dprorun.fsutil import atomic_write_json, make_private_dir
from dprorun.layout import CLEAN_SCHEMA, EVENTS_FILE, EVENTS_SCHEMA, SAMPLES_FILE

if TYPE_CHECKING:
    from dprorun.runtime.session import RankSession


def events_document(session: RankSession) -> dict:
    """events.json: the rank's records and the window they were taken in."""
    cfg = session.cfg
    return {
        "schema": EVENTS_SCHEMA,
        "version": 1,
        "job_id": cfg.job_id,
        "rank": session.rank,
        "local_rank": session.local_rank,
        "world_size": session.world_size,
        "host": session.host,
        "pid": os.getpid(),
        "phase": session.phase,
        "disabled": session.disabled,
        "comm_detail": cfg.comm_detail,
        "window": {"warmup": cfg.warmup, "active": cfg.active, "clean": cfg.clean,
                   "start_us": session.window_start_us,
                   "end_us": session.window_end_us,
                   # the iteration where the script's switch to another model ended the window or the clean ones
                   "cut_at": session.profiling_cut_at,
                   "kineto": cfg.kineto and cfg.kineto_iters > 0 and not session.script_profiler.refused_ours,
                   "record_shapes": cfg.record_shapes,
                   "kineto_iterations": list(range(session.kineto_start_iteration, session.kineto_end_iteration))},
        "disturbed_iterations": session.records.disturbed_iterations,
        "script_profiler_iterations": session.records.script_profiler_iterations,
        "inference_passes": sorted(session.records.inference_passes.items()),
        "clock": {"source": "time.time_ns", "wall_start_us": session.wall_start_us,
                  "monotonic_start_ns": session.monotonic_at_start_ns,
                  # the test knob's shift of every hook timestamp; a profiler file that keeps the process's own
                  # clock (TensorFlow's xplane) is shifted by it when read
                  "test_skew_us": session.skew_us,
                  # which kernel's clock this is (one per machine and boot): ranks that share it need no alignment
                  "boot_id": boot_id()},
        "iteration_starts_us": session.records.iteration_starts,
        "iteration_cpu_s": session.records.iteration_cpu_s,
        "host_cpu_stat": session.records.host_cpu_stat,
        "spans": session.records.spans,
        "script_collectives": [[i, name, calls, round(us, 1)]
                               for (i, name), (calls, us) in sorted(session.records.script_collectives.items())],
        "comm": [c.row() for c in session.records.comm if c.done_us is not None],
        "comm_unfinished": sum(1 for c in session.records.comm if c.done_us is None),
        "grad_ready": session.records.grad_ready,
        "p2p": [r.row() for r in session.records.p2p],
        "clock_probes": session.records.probes,
        "calibration": session.records.calibration,
        "calibration_under_compute": session.records.calibration_under_compute,
        "calibration_dtypes": session.records.calibration_dtypes,
        "cpu": session.records.cpu_budget,
        "buckets": [dict(ddp=k[0], index=k[1], **v) for k, v in sorted(session.records.buckets.items())],
        "params": {str(k): v for k, v in session.records.params.items()},
        "memory": session.records.memory,
        "trackers": [t.describe() for t in session.trackers],
        "files": sorted(set(session.records.files_written)),
        "warnings": session.records.warnings + [p for p in session.script_use.problems
                                                if p not in session.records.warnings],
        "strategy": None if session.strategy is None else {"file": os.environ.get("DPRO_STRATEGY"),
                                                        "applied": session.strategy_applied},
        "versions": versions(),
    }


def write_events(session: RankSession) -> None:
    make_private_dir(session.rank_dir)
    with session.lock:
        doc = events_document(session)
    atomic_write_json(os.path.join(session.rank_dir, EVENTS_FILE), doc)
    if session.sampler is not None:
        atomic_write_json(os.path.join(session.rank_dir, SAMPLES_FILE), session.sampler.export())


def clean_document(session: RankSession, rank: Optional[int] = None, starts: Optional[list[float]] = None,
                   complete: bool = True, script_marks: Optional[list[int]] = None) -> dict:
    """clean.json: the start times of iterations W+K.. (the clean ones and the boundary after them); for another
    rank (rank 0 writing it for a rank on another disk) its starts and the iterations it ran under the script's
    profiler (script_marks)."""
    first = session.cfg.warmup + session.cfg.active
    own = [float(t) for t in session.records.iteration_starts[first:first + session.cfg.clean + 1]]
    doc = {"schema": CLEAN_SCHEMA, "version": 1, "rank": session.rank if rank is None else rank,
           "first_iteration": first, "iteration_starts_us": own if starts is None else starts, "complete": complete}
    if starts is None:  # this rank's own document: its CPU seconds at those starts and its host's quota counters
        doc["iteration_cpu_s"] = session.records.iteration_cpu_s[first:first + session.cfg.clean + 1]
        doc["host_cpu_stat"] = session.records.host_cpu_stat
        doc["script_profiler_iterations"] = session.records.script_profiler_iterations
    elif script_marks:
        doc["script_profiler_iterations"] = script_marks
    return doc


def record_memory(session: RankSession) -> None:
    """Peaks, optimizer state and resident memory at the end of the window, into the records."""
    try:
        if session.framework != "torch":
            raise ImportError("not a torch job")
        import torch

        if torch.cuda.is_available():
            session.records.memory["cuda_max_allocated_bytes"] = int(torch.cuda.max_memory_allocated())
            session.records.memory["cuda_max_reserved_bytes"] = int(torch.cuda.max_memory_reserved())
        state_bytes = 0
        optimizers = [optimizer for ref in session.optimizers if (optimizer := ref()) is not None]
        for optimizer in optimizers:
            for state in optimizer.state.values():
                for value in state.values():
                    if isinstance(value, torch.Tensor):
                        state_bytes += value.numel() * value.element_size()
        session.records.memory["optimizer_state_bytes"] = state_bytes
        session.records.memory["optimizers"] = [type(o).__name__ for o in optimizers]
    except ImportError:
        pass
    except Exception as exc:
        session.records.warnings.append(f"memory accounting failed: {exc}")
    try:
        session.records.memory["rss_bytes_at_window_end"] = current_rss_bytes()
    except Exception:
        pass
    peak = peak_rss_bytes()
    if peak is not None:
        session.records.memory["max_rss_bytes"] = peak


def current_rss_bytes() -> int:
    """This process's resident set now: /proc/self/statm on Linux (no psutil needed: a training environment may
    lack it, where its import had turned the profile off), psutil elsewhere."""
    try:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import psutil

        return int(psutil.Process().memory_info().rss)


def peak_rss_bytes() -> Optional[int]:
    """This process's peak resident set: VmHWM from /proc (Linux), which starts afresh at exec. Not
    getrusage's ru_maxrss: Linux carries that over fork and exec, so a rank started by a launcher that had
    grown large (dprorun after an autotune search had imported cvxpy) reported the launcher's peak."""
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    if sys.platform == "darwin":
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # bytes on macOS
    return None


def versions() -> dict:
    """Python's, dprorun's and the frameworks' versions: only those the job imported itself. Importing torch here
    would load it into a TensorFlow worker at its exit (seconds, hundreds of MB, and torch.library's finalizers
    failing at the interpreter's shutdown when the job ended inside the window)."""
    out = {"python": sys.version.split()[0]}
    for name in ("torch", "tensorflow", "mxnet", "horovod"):
        module = sys.modules.get(name)
        version = getattr(module, "__version__", None) if module is not None else None
        if isinstance(version, str):
            out[name] = version
    try:
        from dprorun import __version__

        out["dprorun"] = __version__
    except Exception:
        pass
    return out


def boot_id() -> str:
    """The running kernel's boot id (Linux; "" elsewhere): processes that read the same one read one wall clock."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as handle:
            return handle.read().strip()
    except OSError:
        return ""
