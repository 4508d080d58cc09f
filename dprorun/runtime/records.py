"""What one rank records while it is profiled: the buffers behind its events.json, filled by the hooks
(runtime/ddp.py, horovod.py, tf.py, mxnet.py, gather.py, ...) and written by runtime/rank_files.py."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dprorun.layout import CommRecord, P2PRecord

MAX_ITERATION_TIMESTAMPS = 100_000


@dataclass
class RankRecords:
    iteration_starts: list[float] = field(default_factory=list)  # epoch µs, one per iteration (capped)
    iteration_cpu_s: list[float] = field(default_factory=list)  # the process's CPU seconds (all threads) at each start
    host_cpu_stat: list[list] = field(default_factory=list)  # [iteration, epoch µs, cgroup cpu.stat] at phase changes
    spans: list[list] = field(default_factory=list)  # [iteration, name, start_us, end_us]
    comm: list[CommRecord] = field(default_factory=list)  # one per bucket (or Horovod tensor) and iteration
    grad_ready: list[tuple] = field(default_factory=list)  # (iteration, param name, time_us)
    p2p: list[P2PRecord] = field(default_factory=list)  # ring detail (--comm-detail ring): every SEND and RECV
    probes: list[list] = field(default_factory=list)  # clock probes: [peer, round, "origin"/"echo", t_a, t_b]
    buckets: dict[tuple[int, int], dict] = field(default_factory=dict)  # (ddp, bucket index) -> sizes, params
    params: dict[int, dict] = field(default_factory=dict)  # ddp index -> {"order": [...], "bytes": {...}}
    memory: dict[str, Any] = field(default_factory=dict)  # peaks, optimizer state, activations (bytes)
    calibration: list[list[float]] = field(default_factory=list)  # all-reduce [bytes, µs, ...] on an idle job
    calibration_under_compute: list[list[float]] = field(default_factory=list)  # the same while compute runs
    calibration_dtypes: list[list] = field(default_factory=list)  # Horovod: [dtype, bytes, µs, float32 µs]
    cpu_budget: dict = field(default_factory=dict)  # runtime/cpubudget.py, at the end of the window
    disturbed_iterations: list[int] = field(default_factory=list)  # paused by dprorun's own work
    script_profiler_iterations: list[int] = field(default_factory=list)  # run (in part) under the script's profiler
    # forward passes that train nothing (a validation pass, a teacher's forward) per iteration that had any: which
    # of those iterations the statistics leave out is the reader's (trace/rundir.inference_set_aside)
    inference_passes: dict[int, int] = field(default_factory=dict)
    # collectives the script called itself in the window's iterations (runtime/watch.py), beside the gradient buckets:
    # (iteration, torch.distributed function) -> [calls, µs]
    script_collectives: dict[tuple[int, str], list] = field(default_factory=dict)
    files_written: list[str] = field(default_factory=list)  # this rank's files in the run directory
    warnings: list[str] = field(default_factory=list)  # what went wrong or was left out, said in the summary

    def mark_script_profiled(self, iteration: int) -> None:
        if iteration >= 0 and iteration not in self.script_profiler_iterations[-1:]:
            self.script_profiler_iterations.append(iteration)

    def add_script_collective(self, iteration: int, name: str, us: float) -> None:
        entry = self.script_collectives.setdefault((iteration, name), [0, 0.0])
        entry[0] += 1
        entry[1] += us

    def count_inference_pass(self, iteration: int) -> None:
        if iteration >= 0:
            self.inference_passes[iteration] = self.inference_passes.get(iteration, 0) + 1

    def keep_first_iteration(self) -> None:
        """The iterations counted so far were one (runtime/session.count_optimizer_steps): only its start stays."""
        del self.iteration_starts[1:], self.iteration_cpu_s[1:]
        self.inference_passes = {i: n for i, n in self.inference_passes.items() if i <= 0}

    def add_iteration_start(self, now_us: float, cpu_s: float) -> None:
        if len(self.iteration_starts) < MAX_ITERATION_TIMESTAMPS:
            self.iteration_starts.append(now_us)
            self.iteration_cpu_s.append(cpu_s)
