"""torch.profiler as a rank's profiler backend (the interface the TensorFlow and MXNet hooks' backends share:
start_profiler(), stop_profiler(write), step()): CPU (and CUDA) activities over the window's first --kineto-iters
iterations, an always-RECORD schedule so that step() writes ProfilerStep#<iteration> annotations (as Holistic
Trace Analysis expects), exported as Chrome JSON to rank_<r>/kineto_trace.json within the disk and size limits.
"""
from __future__ import annotations

import os
import re
import threading
from typing import TYPE_CHECKING

from dprorun.fsutil import free_mb, make_private_dir
from dprorun.layout import KINETO_FILE
from dprorun.runtime.gloo_exit import wait_for_idle_gloo_workers, wait_s_from_env
from dprorun.runtime.log import warn
from dprorun.runtime.script_profiler import ProfilerBusy, torch_busy

if TYPE_CHECKING:
    from dprorun.runtime.session import RankSession

PROFILER_STOP_WAIT_S = 0.2  # at most this long for gloo's worker threads to go idle before the profile stops


def profiler_stop_wait_s() -> float:
    """DPRO_PROFILER_STOP_WAIT_S, else PROFILER_STOP_WAIT_S (0: no wait; benchmarks/abort_rate.py compares)."""
    return wait_s_from_env("DPRO_PROFILER_STOP_WAIT_S", PROFILER_STOP_WAIT_S)


def _say_why_torch_errs_off_the_main_thread(rank: int) -> None:
    """torch's first profiler started off the main thread (a script training in a thread of its own, as Ray
    Train's wrappers do) makes kineto print `ERROR: External init callback must run in same thread as
    registerClient` on every rank, under torchrun as under dprorun; the profile is recorded all the same. Rank 0
    says so once, before the line."""
    import sys

    thread = threading.current_thread()
    if rank == 0 and thread is not threading.main_thread():
        print(f"[dprorun] torch.profiler starts in the script's thread {thread.name!r}, not the main thread: the "
              "'ERROR: External init callback must run in same thread as registerClient' lines that follow are "
              "torch's own for that, and harmless (the profile is recorded)", file=sys.stderr, flush=True)


class TorchProfiler:
    def __init__(self, session: "RankSession"):
        self.session = session
        self.profile = None
        self.thread = None  # the thread that started the profile: torch keeps a profile per thread

    def start_profiler(self) -> None:
        import torch
        from torch.profiler import ProfilerAction, ProfilerActivity, profile

        session = self.session
        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        if session.cfg.test_fault == "profiler":
            raise RuntimeError("injected profiler failure (DPRO_TEST_FAULT=profiler)")
        if torch_busy(session.script_profiler):
            raise ProfilerBusy(session.script_profiler.name)
        _say_why_torch_errs_off_the_main_thread(session.rank)
        self.profile = profile(activities=activities, record_shapes=session.cfg.record_shapes, profile_memory=False,
                               with_stack=False, schedule=lambda step: ProfilerAction.RECORD)
        self.profile.step_num = session.iteration
        self.profile.start()
        self.thread = threading.current_thread()

    def step(self) -> None:
        if self.profile is not None:
            self.profile.step()

    def stop_profiler(self, write: bool) -> None:
        profile, self.profile = self.profile, None
        if profile is None:
            return
        # gloo's worker threads finish what they ran first: a comm hook's callback and the work's teardown
        # (runtime/gloo_exit.py) still running on one when the profile stopped corrupted the rank's heap
        wait_for_idle_gloo_workers(profiler_stop_wait_s())
        profile.stop()  # from another thread too: a profile left running ended the process in SIGSEGV at its exit
        started = self.thread
        if started is not None and started is not threading.current_thread():
            # torch's profile lives in the thread that started it: stopped from another (the script's training
            # thread raised inside the profiled iterations, the job ended from the main thread) it holds nothing,
            # and exporting it ended the rank in SIGSEGV where torchrun's job exited 0
            self._dropped(f"torch.profiler was started in the script's thread {started.name!r}, which "
                          f"{'ended' if not started.is_alive() else 'was elsewhere'} inside the profiled iterations: "
                          "torch keeps the profile in that thread, so the op-level profile of the window is lost")
            return
        if write:
            self._export(profile)

    def _dropped(self, message: str) -> None:
        self.session.records.warnings.append(message)
        warn(message)

    def _export(self, profile) -> None:
        session = self.session
        make_private_dir(session.rank_dir)
        final = os.path.join(session.rank_dir, KINETO_FILE)
        tmp = final + f".{os.getpid()}.tmp"
        limit = session.cfg.min_free_mb
        if free_mb(session.rank_dir) < limit:
            self._dropped(f"only {free_mb(session.rank_dir):.0f} MB free where the traces go (below "
                          f"DPRO_MIN_FREE_MB={limit:.0f}): the profiler trace was not written, so that the job "
                          "keeps the disk")
            return
        try:
            profile.export_chrome_trace(tmp)
        except OSError as exc:  # e.g. the disk filled up: leave nothing behind that keeps it full
            for leftover in (tmp, tmp + ".tmp"):
                if os.path.exists(leftover):
                    os.unlink(leftover)
            self._dropped(f"the profiler trace could not be written ({exc.strerror}): dropped")
            return
        size_mb = os.path.getsize(tmp) / 1e6
        if free_mb(session.rank_dir) < limit:
            os.unlink(tmp)
            self._dropped(f"the profiler trace ({size_mb:.0f} MB) would leave less than {limit:.0f} MB free "
                          "(DPRO_MIN_FREE_MB): dropped")
            return
        if size_mb > session.cfg.max_trace_mb:
            os.unlink(tmp)
            self._dropped(f"Kineto trace of {size_mb:.0f} MB exceeds the cap of {session.cfg.max_trace_mb:.0f} MB "
                          "(DPRO_MAX_TRACE_MB) and was dropped")
            return
        if session.skew_us:
            self._shift_base(tmp)
        os.chmod(tmp, 0o600)
        os.replace(tmp, final)
        session.records.files_written.append(KINETO_FILE)

    def _shift_base(self, path: str) -> None:
        """Apply the test clock skew to the profiler's timestamps too (they are relative to this base)."""
        with open(path, "r") as handle:
            text = handle.read()
        shift_ns = int(round(self.session.skew_us * 1000))

        def shifted(match: "re.Match") -> str:
            return f'"baseTimeNanoseconds": {int(match.group(1)) + shift_ns}'

        text, count = re.subn(r'"baseTimeNanoseconds"\s*:\s*(\d+)', shifted, text, count=1)
        if count == 0:
            self.session.records.warnings.append("Kineto trace has no baseTimeNanoseconds; test clock skew not applied to it")
        with open(path, "w") as handle:
            handle.write(text)
