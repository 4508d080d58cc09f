"""One analysis of one run directory: read once, aligned once, modelled once (the facade every stage after the
job uses: finalize, `dpro` commands, the report, autotune).

Each product is computed on first use and kept: the run (trace/rundir.load_run), its summary (per-rank
breakdowns do not depend on clock offsets), the alignment (solved once, written to alignment.json, applied to
the run in place), the replay model of the aligned run and the prediction of the job as it ran. `reads` and
`solves` count the work done, so tests can hold the "once" to account.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from dprorun.fsutil import atomic_write_json
from dprorun.layout import ALIGNMENT_FILE

if TYPE_CHECKING:
    from dprorun.align import Alignment
    from dprorun.replay.template import JobModel
    from dprorun.replay.predict import Prediction
    from dprorun.trace.model import RunTrace


@dataclass
class RunAnalysis:
    run_dir: str
    reads: int = 0
    solves: int = 0
    _run: Optional["RunTrace"] = field(default=None, repr=False)
    _summary: Optional[dict] = field(default=None, repr=False)
    _alignment: Optional["Alignment"] = field(default=None, repr=False)
    _model: Optional["JobModel"] = field(default=None, repr=False)
    _prediction: Optional["Prediction"] = field(default=None, repr=False)

    @property
    def run(self) -> "RunTrace":
        """The run as read (aligned in place once `alignment` has been asked for)."""
        if self._run is None:
            from dprorun.trace.rundir import load_run

            self._run = load_run(self.run_dir)
            self.reads += 1
        return self._run

    @property
    def summary(self) -> dict:
        if self._summary is None:
            from dprorun.summary import summarize

            self._summary = summarize(self.run)
        return self._summary

    @property
    def alignment(self) -> "Alignment":
        if self._alignment is None:
            from dprorun.align import align, apply_alignment

            run = self.run
            self._alignment = align(run)
            self.solves += 1
            atomic_write_json(os.path.join(self.run_dir, ALIGNMENT_FILE), self._alignment.to_json(), indent=2)
            apply_alignment(run, self._alignment)
        return self._alignment

    @property
    def aligned_run(self) -> "RunTrace":
        self.alignment
        return self.run

    @property
    def model(self) -> "JobModel":
        if self._model is None:
            from dprorun.replay.build import build_job_model

            self._model = build_job_model(self.aligned_run)
        return self._model

    @property
    def prediction(self) -> "Prediction":
        """The replay of the job as it ran, with its self-check against the clean iterations."""
        if self._prediction is None:
            from dprorun.replay.predict import predict

            self._prediction = predict(self.model)
        return self._prediction


def optimize_run(run_dir: str, memory_budget_bytes: Optional[int] = None, allow_bf16: bool = False,
                 comm_passes: Optional[bool] = None):
    """Search a strategy for the run in `run_dir` (read and aligned once); returns (strategy, aligned run)."""
    from dprorun.memory import run_memory
    from dprorun.optimize import MemoryModel, optimize

    analysis = RunAnalysis(run_dir)
    model = analysis.model
    strategy = optimize(model, MemoryModel(run_memory(analysis.aligned_run)), memory_budget_bytes,
                        allow_bf16=allow_bf16, comm_passes=comm_passes)
    strategy.source_run = os.path.abspath(run_dir)
    strategy.search["as_run_replay_ms"] = analysis.prediction.predicted_iteration_time_ms
    return strategy, analysis.aligned_run
