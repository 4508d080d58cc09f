"""`dprorun --autotune`: profile, search, restart with the strategy, keep it only if it is measured faster.

Phases (each printed as it starts; every decision logged to RUN_DIR/autotune.json):
  1. profiling   the job's profiling window only (as --dry-run), job settings as given  -> RUN_DIR/autotune/profile
  2. searching   dprorun.optimize on that run                                           -> RUN_DIR/strategy.json
  3. trial       the window again with the strategy applied by the hooks                 -> RUN_DIR/autotune/trial
                 (not faster, and it holds op fusion / bf16 with other decisions: a second trial without
                 those, whose gain rests on a short timing of the model)      -> RUN_DIR/autotune/trial-without-compute
  4. deciding    never-regress: the strategy is kept only if the trial's measured iteration time beats the
                 profile's by more than `min_gain`, and again in each of `rounds` - 1 more rounds (a window with the
                 job's own settings, then one with the trial's, interleaved: launch-to-launch noise on a shared
                 machine is several %, and the fastest of several candidates measured once is luckier still)
                                                      -> RUN_DIR/autotune/own-settings-round2, trial-round2
  5. running     the whole job, with the strategy or with its own settings, profiled as usual -> RUN_DIR
Horovod jobs (--backend horovod): the search ranks fusion threshold x cycle time by replay and the top two each
get a trial window (RUN_DIR/autotune/trial, trial2); the fastest measured is judged. TensorFlow jobs: the same
over all-reduce pack sizes; MXNet parameter-server jobs: over MXNET_KVSTORE_BIGARRAY_BOUND (optimize/ps.py).
A strategy with nothing to change skips the trial. Parts the hooks cannot apply (gradient accumulation) are
printed as recommendations; `dprorun.strategy()` gives them to a script that wants them.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import os
import shutil
import statistics
import sys
import time
from typing import Callable, Optional

from dprorun.config import JobConfig
from dprorun.fsutil import atomic_write_json, make_private_dir
from dprorun.strategy import Strategy


def _phase(job: JobConfig, text: str) -> None:
    if not job.output.quiet:  # under --json on stderr: stdout holds the final run's summary alone
        print(f"dprorun autotune: {text}", flush=True, file=sys.stderr if job.output.json_summary else sys.stdout)


def _measured_ms(run_dir: str) -> Optional[float]:
    """The phase's measured iteration time, from the summary.json its finalize just wrote (read again only when
    that is missing)."""
    from dprorun.fsutil import TraceError, read_json

    try:
        summary = read_json(os.path.join(run_dir, "summary.json"))
        if isinstance(summary, dict) and "iteration_time_ms" in summary:
            return summary["iteration_time_ms"]
    except TraceError:
        pass
    from dprorun.summary import summarize_run

    return summarize_run(run_dir).get("iteration_time_ms")


def _final_ms(run_dir: str) -> Optional[float]:
    """The whole job's measured iteration time, for the check after it; None where its summary cannot say."""
    from dprorun.fsutil import TraceError, UnanswerableError

    try:
        return _measured_ms(run_dir)
    except (TraceError, UnanswerableError, ValueError, OSError):
        return None


def _sub_job(job: JobConfig, run_dir: str, dry_run: bool, strategy_file: Optional[str],
             judged: bool = False) -> JobConfig:
    """The job of one phase; `judged`: a window measured for its time alone, as a trial is (a confirmation round
    of the job's own settings: no compute variants timed, TensorFlow's profiler off)."""
    sub = copy.deepcopy(job)
    sub.output.run_dir = run_dir
    sub.profile.run_dir = run_dir
    sub.profile.dry_run = dry_run
    # the profiling window also times the model eager / compiled / bf16 for the op-fusion and precision passes
    sub.profile.measure_variants = dry_run and strategy_file is None and job.autotune.variants and not judged
    sub.profile.job_id = f"{job.profile.job_id}-{os.path.basename(run_dir)}" if dry_run else job.profile.job_id
    sub.strategy_file = strategy_file
    if job.launch.backend == "horovod" and strategy_file:  # Horovod's knobs go to horovodrun, the strategy's win
        from dprorun.config import horovod_knob_args
        from dprorun.strategy import load_strategy

        chosen = load_strategy(strategy_file)
        sub.horovod.args = horovod_knob_args(chosen.horovod_fusion_threshold_mb, chosen.horovod_cycle_time_ms)
    if job.launch.backend == "tf" and (strategy_file or judged):
        # a TensorFlow trial is judged by its measured iterations only, and TF's profiler can crash a worker at its
        # stop (RESULTS.md, TensorFlow): the trial runs without it
        sub.profile.kineto = False
    sub.autotune.enabled = False
    sub.output.quiet = True if dry_run else job.output.quiet
    sub.output.json_summary = job.output.json_summary  # a window's summary is swallowed (_quietly); under --json
    # its ranks' stdout goes to stderr, as the final run's
    return sub


def _quietly(finalize: Callable, job: JobConfig, result) -> int:
    """Finalize a profiling/trial window without printing its summary (errors still go to stderr). A window the
    replayer cannot model (a TensorFlow trial under XLA: its steps' ops are fused clusters, with no forward /
    backward / update to tell apart) still has its measured iteration time in summary.json: that is what a trial
    is judged by, so a failed prediction is a warning here, not the end of the tuning; a window run without the
    profiler by design (a TensorFlow trial) has none to make, and nothing is said of it (it printed "error: no
    prediction" for every TF trial of a healthy tuning)."""
    from dprorun.finalize import NO_PREDICTION, NO_REPLAY
    from dprorun.fsutil import TraceError, UnanswerableError

    said, code = io.StringIO(), None
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(said):
        try:
            code = finalize(job, result)
        except (UnanswerableError, TraceError, ValueError) as exc:
            print(f"{NO_PREDICTION}{exc}", file=sys.stderr)
            code = result.exit_code
    printed = set()
    for line in said.getvalue().splitlines():
        unreplayed = line.startswith((NO_PREDICTION, NO_REPLAY))
        if unreplayed and (not job.profile.kineto or "nothing was profiled" in line):  # the latter: said after it
            continue
        if unreplayed:
            detail = line[len(NO_PREDICTION if line.startswith(NO_PREDICTION) else NO_REPLAY):]
            detail = detail.split("; the run directory is kept")[0]
            line = (f"dprorun: warning: {os.path.basename(job.output.run_dir)}: no prediction ({detail}); judged by "
                    "its measured iterations")
        if line not in printed:
            print(line, file=sys.stderr)
            printed.add(line)
    return code


def run_autotune(job: JobConfig, launch: Callable, finalize: Callable) -> int:
    """Drive the phases; `launch` and `finalize` are dprorun.launch.launch and dprorun.finalize.finalize_run."""
    tune = _Autotune(job, launch, finalize)
    profiled = tune.profile()
    if isinstance(profiled, int):
        return profiled  # the profiling run failed: its exit code
    searched = tune.search(profiled)
    if isinstance(searched, int):
        return searched
    strategy, candidates, profiled_run = searched
    if strategy.is_default() or not strategy.decisions:
        tune.record("deciding", keep=False, reason="the job's own settings are already the best found",
                    tuning_seconds=round(time.monotonic() - tune.started, 2))
        _phase(job, "the job's own settings are already the best found; keeping them")
        return tune.final(None, "with its own settings (already the best found)")
    keep, trial_ms, label, message = tune.trials(strategy, candidates, profiled_run, profiled)
    return tune.decide(keep, trial_ms, label, message, profiled)


OWN = "the job's own settings"


class _Autotune:
    """One --autotune: the run's log (autotune.json) and the phases, each a method."""

    def __init__(self, job: JobConfig, launch: Callable, finalize: Callable):
        self.job, self.launch, self.finalize = job, launch, finalize
        make_private_dir(job.output.run_dir)
        self.tune_dir = make_private_dir(os.path.join(job.output.run_dir, "autotune"))
        self.log: dict = {"job_id": job.profile.job_id, "command": job.command, "started": time.time(), "phases": []}
        self.log_path = os.path.join(job.output.run_dir, "autotune.json")
        self.strategy_path = os.path.join(job.output.run_dir, "strategy.json")
        self.started = time.monotonic()
        self.rounds: list[tuple[float, float]] = []  # (own settings ms, kept trial ms) per judged round
        self.unconfirmed = ""  # why a trial that beat the profile was not confirmed, where a window failed

    def record(self, name: str, **values) -> None:
        self.log["phases"].append({"phase": name, "time": round(time.time(), 3), **values})
        atomic_write_json(self.log_path, self.log, indent=2)

    def final(self, strategy_file: Optional[str], why: str) -> int:
        """Phase 5: the whole job, with the strategy or with its own settings."""
        _phase(self.job, f"running the job {why}")
        self.record("running", strategy=strategy_file, reason=why)
        sub = _sub_job(self.job, self.job.output.run_dir, False, strategy_file)
        code = self.finalize(sub, self.launch(_sub_job(self.job, self.job.output.run_dir, False, strategy_file)))
        measured = _final_ms(self.job.output.run_dir) if code == 0 and strategy_file and self.rounds else None
        own = statistics.median(b for b, _ in self.rounds) if measured is not None else None
        if measured is not None and measured > own:  # the kept strategy's gain, checked once more by the job itself
            print(f"dprorun: warning: autotune: the job's window with the strategy ran at {measured:.2f} ms per "
                  f"iteration, slower than its own settings' {own:.2f} ms in the tuning windows: the gain measured "
                  "there did not hold in this launch (launch-to-launch noise here is several %; compare the two in "
                  "autotune.json)", file=sys.stderr)
        self.record("done", exit_code=code, measured_ms=measured)
        return code

    def profile(self):
        """Phase 1: the profiling window with the job's own settings; (run dir, measured ms) or an exit code."""
        job = self.job
        _phase(job, f"1/4 profiling {job.profile.warmup}+{job.profile.active} iterations with the job's own settings")
        profile_job = _sub_job(job, os.path.join(self.tune_dir, "profile"), True, None)
        result = self.launch(profile_job)
        _quietly(self.finalize, profile_job, result)
        if result.exit_code != 0:
            self.record("profiling", exit_code=result.exit_code, message=result.message)
            print(f"dprorun: error: autotune stopped: the profiling run failed ({result.message}); its traces are "
                  f"in {profile_job.output.run_dir}", file=sys.stderr)
            return result.exit_code
        from dprorun.layout import ranks_with_records

        if not ranks_with_records(profile_job.output.run_dir):  # no window stopped the job: it ran to its end
            self.record("profiling", exit_code=0, message="nothing was profiled")
            print("dprorun: warning: autotune: nothing was profiled (above), so nothing was tuned: the job ran to its "
                  f"end with its own settings; its run directory: {profile_job.output.run_dir}", file=sys.stderr)
            return 0
        baseline_ms = _measured_ms(profile_job.output.run_dir)
        self.record("profiling", run_dir=profile_job.output.run_dir, measured_ms=baseline_ms)
        return profile_job.output.run_dir, baseline_ms

    def search(self, profiled):
        """Phase 2: the strategy (Horovod, TensorFlow: knob candidates ranked by replay); (strategy, candidates,
        the aligned profiled run or None) or an exit code."""
        from dprorun.analysis import optimize_run
        from dprorun.optimize import BudgetError
        from dprorun.strategy import save_strategy

        job = self.job
        run_dir, _ = profiled
        _phase(job, "2/4 searching a strategy on the replayed job")
        candidates = []
        try:
            if job.launch.backend in ("horovod", "tf", "mxnet"):
                candidates = _knob_candidates(run_dir, job.launch.backend)[:job.autotune.max_trials]
                strategy = candidates[0] if candidates else Strategy(search={"framework": job.launch.backend})
                profiled_run = None
            else:
                strategy, profiled_run = optimize_run(run_dir, job.autotune.memory_budget_bytes,
                                                      job.autotune.allow_bf16)
        except BudgetError as exc:
            self.record("searching", error=str(exc))
            print(f"dprorun: error: autotune: {exc}", file=sys.stderr)
            return 3
        except Exception as exc:  # a failed search must never cost the job: run it with its own settings
            self.record("searching", error=f"{type(exc).__name__}: {exc}")
            print(f"dprorun: warning: autotune search failed ({exc}); running with the job's own settings",
                  file=sys.stderr)
            return self.final(None, "with its own settings (search failed)")
        save_strategy(strategy, self.strategy_path)
        self.record("searching", strategy=self.strategy_path, baseline_replay_ms=strategy.baseline_ms,
                    predicted_ms=strategy.predicted_ms, decisions=[d.to_json() for d in strategy.decisions],
                    search=strategy.search)
        if not job.output.quiet:
            for line in strategy.summary_lines():
                _phase(job, f"  {line.strip()}")
            for key, what in (("comm_passes", "communication"), ("partitions", "partition"),
                              ("compute_passes", "op fusion and bf16")):
                if key in strategy.search:
                    _phase(job, f"  {what} passes {strategy.search[key]}")
        return strategy, candidates, profiled_run

    def _trial_list(self, strategy: Strategy, candidates: list, profiled_run) -> tuple[list, bool]:
        """[(strategy file, label, folder)] to measure, and whether every one is measured (knob candidates) or
        the first that beats the profile is kept."""
        from dprorun.strategy import save_strategy

        trials = [(self.strategy_path, "the strategy", "trial")]
        keep_best = len(candidates) > 1  # Horovod, TensorFlow: the replay ranks knobs, real trials decide
        if keep_best:
            for k, other in enumerate(candidates[1:], start=2):
                other_path = os.path.join(self.job.output.run_dir, f"strategy-candidate{k}.json")
                save_strategy(other, other_path)
                trials.append((other_path, f"candidate {k} ({other.decisions[0].choice})", f"trial{k}"))
            trials[0] = (self.strategy_path, f"candidate 1 ({strategy.decisions[0].choice})", "trial")
        without = _without_compute_passes(strategy, profiled_run) if profiled_run is not None else None
        if without is not None:  # compute passes rest on a short measurement: if the whole strategy is not
            # faster, the communication part alone gets its own trial before everything is reverted
            without_path = os.path.join(self.job.output.run_dir, "strategy-without-compute.json")
            save_strategy(without, without_path)
            trials.append((without_path, "the strategy without op fusion / bf16", "trial-without-compute"))
        return trials, keep_best

    def trials(self, strategy: Strategy, candidates: list, profiled_run, profiled):
        """Phase 3: trial windows; (keep, measured ms, label, failure message)."""
        job, min_gain = self.job, self.job.autotune.min_gain
        _, baseline_ms = profiled
        trials, keep_best = self._trial_list(strategy, candidates, profiled_run)
        keep, trial_ms, result, label = False, None, None, ""
        measured: list[tuple[float, str, str]] = []
        for number, (path, trial_label, folder) in enumerate(trials):
            _phase(job, f"3/4 trial window with {trial_label} applied")
            trial_job = _sub_job(job, os.path.join(self.tune_dir, folder), True, path)
            result = self.launch(trial_job)
            _quietly(self.finalize, trial_job, result)
            this_ms = _measured_ms(trial_job.output.run_dir) if result.exit_code == 0 else None
            self.record("trial", run_dir=trial_job.output.run_dir, exit_code=result.exit_code, measured_ms=this_ms,
                        strategy=path)
            if this_ms is not None:
                measured.append((this_ms, path, trial_label))
            if keep_best:  # every candidate is measured; the fastest is judged below
                if this_ms is not None and baseline_ms is not None:
                    _phase(job, f"   measured {baseline_ms:.2f} -> {this_ms:.2f} ms with {trial_label}")
                continue
            trial_ms, label = this_ms, trial_label
            keep = trial_ms is not None and baseline_ms is not None and trial_ms < baseline_ms * (1 - min_gain)
            if keep:
                if path != self.strategy_path:  # what runs is what strategy.json says
                    shutil.copyfile(path, self.strategy_path)
                break
            if number + 1 < len(trials) and trial_ms is not None and baseline_ms is not None:
                _phase(job, f"   measured {baseline_ms:.2f} -> {trial_ms:.2f} ms with {trial_label}: not better by "
                            f"{100 * min_gain:.0f} %")
        if keep_best and measured:
            trial_ms, path, label = min(measured)
            keep = baseline_ms is not None and trial_ms < baseline_ms * (1 - min_gain)
            if keep and path != self.strategy_path:
                shutil.copyfile(path, self.strategy_path)
        if keep:
            keep, trial_ms = self.confirm(self.strategy_path, label, baseline_ms, trial_ms)
        return keep, trial_ms, label, result.message if result is not None else ""

    def confirm(self, path: str, label: str, baseline_ms: float, trial_ms: float) -> tuple[bool, Optional[float]]:
        """Rounds 2..N of the judgement: the job's own settings, then the kept trial, each a window again
        (interleaved with the first pair: profile, trial, own settings, trial, ...). One window of each is at the
        mercy of this machine's launch-to-launch noise (3-13 % here), and the fastest of several candidates
        measured once more so; kept only if the trial is faster by `min_gain` in every round. (keep, the trial's
        median ms over the rounds); every round in self.rounds and autotune.json."""
        job, min_gain = self.job, self.job.autotune.min_gain
        self.rounds = [(baseline_ms, trial_ms)]
        for number in range(2, job.autotune.rounds + 1):
            pair = []
            for folder, strategy_file, what in ((f"own-settings-round{number}", None, OWN),
                                                (f"trial-round{number}", path, label)):
                _phase(job, f"3/4 round {number} of {job.autotune.rounds}: a window with {what}")
                sub = _sub_job(job, os.path.join(self.tune_dir, folder), True, strategy_file, judged=True)
                result = self.launch(sub)
                _quietly(self.finalize, sub, result)
                ms = _measured_ms(sub.output.run_dir) if result.exit_code == 0 else None
                self.record("confirming", round=number, run_dir=sub.output.run_dir, strategy=strategy_file,
                            exit_code=result.exit_code, measured_ms=ms)
                pair.append(ms)
            if None in pair:
                self.unconfirmed = (f"not confirmed: round {number}'s window with "
                                    f"{OWN if pair[0] is None else label} failed")
                return False, trial_ms
            self.rounds.append((pair[0], pair[1]))
            _phase(job, f"   round {number}: measured {pair[0]:.2f} -> {pair[1]:.2f} ms")
        faster = [t < b * (1 - min_gain) for b, t in self.rounds]
        return all(faster), statistics.median(t for _, t in self.rounds)

    def _rounds_said(self) -> str:
        """Each round's gain, as the reason says it: "(+18.2 %, +15.0 %)"."""
        return ", ".join(f"{100 * (1 - t / b):+.1f} %" for b, t in self.rounds)

    def decide(self, keep: bool, trial_ms: Optional[float], label: str, message: str, profiled) -> int:
        """Phase 4 (never regress), then phase 5."""
        _, baseline_ms = profiled
        min_gain = self.job.autotune.min_gain
        rounds = len(self.rounds)
        if rounds > 1:  # the medians of the interleaved rounds, each round's gain said
            baseline_ms = statistics.median(b for b, _ in self.rounds)
        if trial_ms is None:
            reason = f"the trial run failed ({message}): reverting to the job's own settings"
        elif self.unconfirmed:
            reason = f"{self.unconfirmed}: reverting to the job's own settings"
        elif keep:
            reason = (f"measured {baseline_ms:.2f} -> {trial_ms:.2f} ms per iteration "
                      f"({100 * (1 - trial_ms / baseline_ms):.1f} % faster"
                      + (f"; medians of {rounds} interleaved rounds: {self._rounds_said()}" if rounds > 1 else "")
                      + f"): keeping {label}")
        elif rounds > 1:
            wins = sum(t < b * (1 - min_gain) for b, t in self.rounds)
            reason = (f"not confirmed: {label} was faster by {100 * min_gain:.0f} % in {wins} of {rounds} "
                      f"interleaved rounds ({self._rounds_said()}; medians {baseline_ms:.2f} -> {trial_ms:.2f} ms): "
                      "within this machine's launch-to-launch noise, so reverting to the job's own settings")
        else:
            reason = (f"measured {baseline_ms:.2f} -> {trial_ms:.2f} ms per iteration, not better by "
                      f"{100 * min_gain:.0f} %: reverting to the job's own settings")
        self.record("deciding", keep=keep, reason=reason, baseline_ms=baseline_ms, trial_ms=trial_ms,
                    rounds=[list(pair) for pair in self.rounds],
                    strategy=self.strategy_path if keep else None,
                    tuning_seconds=round(time.monotonic() - self.started, 2))
        _phase(self.job, f"4/4 {reason}")
        return self.final(self.strategy_path if keep else None,
                          "with the strategy" if keep else "with its own settings")


def _knob_candidates(run_dir: str, backend: str) -> list:
    """Horovod runs: the best (fusion threshold, cycle time) settings by replay; TensorFlow runs: the best
    all-reduce pack sizes (and XLA); MXNet runs: the best server counts and bounds (and one OpenMP thread a server
    where the servers spun); for real trials."""
    if backend == "mxnet":
        from dprorun.optimize.ps import rank_ps_knobs, server_threads_candidate
        from dprorun.replay.ps_model import build_ps_model

        model = build_ps_model(run_dir)
        candidates = rank_ps_knobs(model)
        threads = server_threads_candidate(model, candidates[0] if candidates else None)
        # first where found (it carries the best knobs too): the replay's knob gains are a few %, spinning servers
        # held a job at twice its pace; a single trial (--autotune-trials 1) measures it
        candidates = ([threads] if threads is not None else []) + candidates
        for candidate in candidates:
            candidate.source_run = os.path.abspath(run_dir)
        return candidates
    from dprorun.analysis import RunAnalysis

    model = RunAnalysis(run_dir).model
    if backend == "tf":
        from dprorun.optimize.tf import rank_tf_packs, xla_candidate

        candidates = rank_tf_packs(model)
        candidates.append(xla_candidate(model, candidates[0] if candidates else None))
    else:
        from dprorun.optimize.horovod import rank_horovod_knobs

        candidates = rank_horovod_knobs(model)
    for candidate in candidates:
        candidate.source_run = os.path.abspath(run_dir)
    return candidates


def _without_compute_passes(strategy, run):
    """The strategy minus op fusion and bf16 (its prediction replayed), when it has both kinds of decision."""
    compute = {"op_fusion", "mixed_precision"}
    if not any(d.pass_name in compute for d in strategy.decisions) or \
            all(d.pass_name in compute for d in strategy.decisions):
        return None
    reduced = dataclasses.replace(strategy, compiled_modules=[], precision="fp32",
                                  decisions=[d for d in strategy.decisions if d.pass_name not in compute])
    from dprorun.optimize.search import whatif_for
    from dprorun.replay.build import build_job_model
    from dprorun.replay.predict import replay_once

    model = build_job_model(run)
    reduced.predicted_ms = round(replay_once(model, whatif_for(reduced, model))[0] / 1000, 4)
    return reduced
