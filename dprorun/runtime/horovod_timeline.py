"""Horovod's timeline over a profiling window's detailed tier, for horovod.torch and horovod.tensorflow workers."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dprorun.runtime.session import RankSession


class WindowTimeline:
    """Horovod's timeline in the window's detailed tier (`--horovod-timeline window`: dprorun's launch sets
    HOROVOD_TIMELINE=DYNAMIC and the session's `horovod_timeline` path): every rank starts and stops it through its
    framework's Horovod module (`module`); only the coordinator writes the file. Recording it for the whole job
    made 2-rank loopback iterations 20 % slower (rank 0 writes every event). Failures disable profiling only."""

    def __init__(self, session: "RankSession", module: str):
        self.session = session
        self.module = module
        self.on = False

    def start(self) -> None:
        self.session.guard("starting Horovod's timeline", self._start)

    def stop(self) -> None:
        self.session.guard("stopping Horovod's timeline", self._stop)

    def _start(self) -> None:
        path = self.session.cfg.horovod_timeline
        if not path or self.on:
            return
        import importlib

        importlib.import_module(self.module).start_timeline(path)
        self.on = True

    def _stop(self) -> None:
        if not self.on:
            return
        import importlib

        self.on = False
        importlib.import_module(self.module).stop_timeline()
