"""After the ranks have stopped: record the outcome in the manifest, print the summary and the run directory."""
from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Optional

from dprorun.analysis import RunAnalysis
from dprorun.config import JobConfig
from dprorun.fsutil import TraceError, atomic_write_json
from dprorun.launch import LaunchResult, write_manifest
from dprorun.layout import ranks_with_records


def _align_at_job_end(analysis: RunAnalysis) -> dict:
    """Clock alignment right after the job; a failure is reported, never fatal (the traces stay on disk)."""
    try:
        return analysis.alignment.to_json()
    except Exception as exc:
        print(f"dprorun: warning: clock alignment failed: {exc}", file=sys.stderr)
        return {"error": str(exc)}


# how a window that replays nothing is said (autotune's windows read these: autotune._quietly)
NO_REPLAY = "dprorun: warning: no replay of the job as it ran: "
NO_PREDICTION = "dprorun: error: no prediction: "


def _self_check_at_job_end(analysis: RunAnalysis) -> Optional[dict]:
    """The replay of the job as it ran against the run's clean iterations (None where nothing replays)."""
    try:
        return analysis.prediction.self_check
    except (ValueError, TraceError) as exc:  # nothing replayable: the report says why
        print(f"{NO_REPLAY}{exc}", file=sys.stderr)
        return None
    except Exception as exc:  # a defect of dprorun's: said as one, the traces kept
        print(f"{NO_REPLAY}{type(exc).__name__}: {exc} (a defect of dprorun's, not of the job: the traces are kept; "
              f"`dpro replay {analysis.run_dir}` shows where it failed)", file=sys.stderr)
        return None


def _print_prediction(job: JobConfig, summary: dict, analysis: RunAnalysis) -> int:
    """--dry-run: the replayer's prediction for the requested world size (and bandwidth)."""
    from dprorun.replay.whatif import WhatIf
    from dprorun.replay.predict import predict

    whatif = WhatIf(world_size=job.predict.np if job.predict.np != job.launch.world_size else None,
                    bandwidth_gbit=job.predict.bandwidth_gbit)
    try:
        model = analysis.model
        prediction = analysis.prediction if whatif.is_identity() else predict(model, whatif)
    except ValueError as exc:  # nothing replayable (e.g. a TF job whose last launch ran without the profiler)
        print(f"{NO_PREDICTION}{exc}; the run directory is kept: {job.output.run_dir}", file=sys.stderr)
        return 1
    if prediction.self_check is None:  # a what-if: the check of the job as it ran comes with it
        prediction.self_check = analysis.prediction.self_check
    doc = prediction.to_json()
    atomic_write_json(os.path.join(job.output.run_dir, "prediction.json"), doc, indent=2)
    if job.output.json_summary:
        print(json.dumps({"run_dir": job.output.run_dir, "job_id": job.profile.job_id,
                          "predicted_iteration_time_ms": prediction.predicted_iteration_time_ms,
                          "world_size": prediction.world_size, "profiled_world_size": job.launch.world_size,
                          "measured_iteration_time_ms": summary.get("iteration_time_ms"),
                          "prediction": doc}, indent=2, default=float))
        return 0
    share = prediction.critical_path["share_pct"]
    print(f"profiled {job.launch.world_size} ranks: measured iteration time {summary.get('iteration_time_ms')} ms")
    low, high = prediction.spread_ms or (None, None)
    print(f"predicted iteration time: {prediction.predicted_iteration_time_ms:.3f} ms "
          f"(for {prediction.world_size} ranks" + (f"; p10-p90 {low:.3f}-{high:.3f} ms" if low is not None else "")
          + ")")
    check = prediction.self_check
    if check and check["message"] not in prediction.notes:
        print(check["message"] if check["status"] != "disagrees" else f"note: {check['message']}")
    print(f"critical path: compute {share['compute']:.1f} %, communication {share['communication']:.1f} %, "
          f"queueing {share['queueing']:.1f} %")
    for row in prediction.critical_path["top"][:5]:
        print(f"  {row['time_on_path_ms']:9.3f} ms  {row['kind']:7} rank {row['rank']:<4} {row['op']}")
    for note in prediction.notes:
        print(f"note: {note}")
    from dprorun.summary import grouped_rank_warnings

    for line in grouped_rank_warnings(summary):  # what the ranks saw (e.g. more threads than cores) counts here too
        print(line)
    print(f"dprorun: run directory {job.output.run_dir}")
    return 0


def _progress(job: JobConfig, what: str) -> None:
    """One line per end-of-job phase on stderr (the summary itself goes to stdout)."""
    if not job.output.quiet and not job.output.json_summary:
        print(f"dprorun: {what} ...", file=sys.stderr, flush=True)


def _write_report(analysis: RunAnalysis) -> None:
    """report.html at job end (what-if curves bounded to a few seconds; `dpro report` draws them all); a failure
    is a warning only."""
    if os.environ.get("DPRO_REPORT", "1") == "0":
        return
    try:
        from dprorun.report import write_report

        write_report(analysis, whatif_time_budget_s=5.0, max_whatif_ops=300_000)  # job end: seconds at most
    except Exception as exc:
        print(f"dprorun: warning: no report.html: {type(exc).__name__}: {exc}", file=sys.stderr)


def _horovod_timeline(job: JobConfig) -> Optional[dict]:
    """Horovod jobs: the coordinator's timeline, read into the trace model and summarised per step."""
    from dprorun.fsutil import TraceError
    from dprorun.launch import HOROVOD_TIMELINE, horovod_timeline_mode
    from dprorun.trace.horovod import read_horovod_timeline, timeline_summary

    path = os.path.join(job.output.run_dir, HOROVOD_TIMELINE)
    if not os.path.exists(path):
        if horovod_timeline_mode(job) != "off":  # off: horovod.torch's hooks time each all-reduce themselves
            print(f"dprorun: warning: Horovod wrote no timeline ({path})", file=sys.stderr)
        return None
    try:
        return timeline_summary(read_horovod_timeline(path))
    except (TraceError, OSError) as exc:
        print(f"dprorun: warning: the Horovod timeline could not be read: {exc}", file=sys.stderr)
        return None


def _horovod_line(summary: dict) -> str:
    steps = summary["per_step"][1:] or summary["per_step"]
    spans = sorted(r["span_ms"] for r in steps)
    median = f", median step span {spans[len(spans) // 2]:.2f} ms" if spans else ""
    return (f"horovod timeline: {summary['tensors']} tensors, {summary['steps']} steps{median}, "
            f"{summary['fused_responses_first_step']} fused responses per step (dpro import-horovod "
            f"{summary['path']} for the per-step table)")


def _finalize_ps(job: JobConfig, result: LaunchResult, with_events: list[int]) -> int:
    """--backend mxnet: the parameter-server model read from the run directory, its replay of the job as it ran
    (and --dry-run's what-if), summary.json and prediction.json; the figures checked against the run's own
    iterations without the profiler."""
    from dprorun.replay.ps import PSWhatIf, format_ps_prediction, predict_ps
    from dprorun.replay.ps_model import build_ps_model

    _progress(job, f"reading the traces of {len(with_events)} workers and the servers' updates")
    try:
        model = build_ps_model(job.output.run_dir)
        as_run = predict_ps(model)
        whatif = PSWhatIf(workers=job.predict.np if job.predict.np != job.launch.world_size else None,
                          bandwidth_gbit=job.predict.bandwidth_gbit)
        prediction = predict_ps(model, whatif) if job.profile.dry_run else as_run
    except Exception as exc:  # the job's outcome stands; the traces stay for dpro replay
        print(f"dprorun: warning: no parameter-server replay: {exc}", file=sys.stderr)
        _outcome_as_json(job, result.exit_code, f"no parameter-server replay: {exc}")
        if not job.output.quiet and not job.output.json_summary:
            print(f"dprorun: run directory {job.output.run_dir}")
        return result.exit_code
    measured = model.measured_iteration_us
    summary = {"run_dir": job.output.run_dir, "job_id": job.profile.job_id,
               "status": "completed" if result.exit_code == 0 else "failed", "exit_code": result.exit_code,
               "command": job.command, "world_size": job.launch.world_size, "ranks_recorded": with_events,
               "backend": "mxnet", "iteration_time_ms": None if measured is None else round(measured / 1000, 3),
               "iteration_reference": model.reference, "model": model.to_json(), "as_run": as_run.to_json(),
               "prediction": prediction.to_json()}
    atomic_write_json(os.path.join(job.output.run_dir, "summary.json"), summary, indent=2)
    if job.profile.dry_run:
        atomic_write_json(os.path.join(job.output.run_dir, "prediction.json"), prediction.to_json(), indent=2)
    if os.environ.get("DPRO_REPORT", "1") != "0":
        _progress(job, "writing report.html")
        try:
            from dprorun.report import write_ps_report

            write_ps_report(job.output.run_dir, model=model)
        except Exception as exc:  # the summary and the traces stand; `dpro report` can try again
            print(f"dprorun: warning: no report.html: {type(exc).__name__}: {exc}", file=sys.stderr)
    if job.output.json_summary:
        print(json.dumps(summary, indent=2, default=float))
    elif not job.output.quiet:
        print(format_ps_prediction(model, prediction))
        print(f"dprorun: run directory {job.output.run_dir}")
    return result.exit_code


def _ranks_that_left_files(job: JobConfig) -> list[int]:
    """Ranks whose folder holds files of a started profile (Kineto's trace, samples) though no events.json."""
    from dprorun.layout import SUBPROCESS_SCRIPTS_FILE, rank_dir

    ranks = []
    for rank in range(job.launch.world_size):
        try:
            if set(os.listdir(rank_dir(job.output.run_dir, rank))) - {SUBPROCESS_SCRIPTS_FILE}:
                ranks.append(rank)
        except OSError:
            continue
    return ranks


def _say_nothing_was_profiled(job: JobConfig) -> None:
    """A job that ran to its end with no rank's records: why, from what rank 0 saw (a script run in a child process
    of its own, or no supported wrapper)."""
    from dprorun.layout import rank_dir
    from dprorun.procs import python_flag_without_the_hooks
    from dprorun.runtime.watch import SUPPORTED_WRAPPERS, read_subprocess_scripts, subprocess_script_advice

    scripts = read_subprocess_scripts(rank_dir(job.output.run_dir, 0))
    flag = python_flag_without_the_hooks(job.command)
    if flag:
        print(f"dprorun: nothing was profiled: the ranks' python ran with {flag}, which keeps dprorun's hooks out "
              "(they load as a sitecustomize on PYTHONPATH); run it without that flag", file=sys.stderr)
    elif scripts:
        advice = subprocess_script_advice(scripts[0], str(job.launch.world_size))
        print(f"dprorun: nothing was profiled: rank 0: {advice}", file=sys.stderr)
    else:
        print(f"dprorun: nothing was profiled: no rank built a wrapper the hooks support ({SUPPORTED_WRAPPERS}); "
              "FSDP on GPUs, tensor or pipeline parallelism, gradients shared by other hand-written collectives "
              "or with no backward() before them, and jobs without a distributed wrapper run unprofiled "
              "(rank 0's log says what it saw)", file=sys.stderr)


def _with_the_scripts_spawned_ranks(job: JobConfig) -> tuple[JobConfig, dict]:
    """A script that started its ranks itself (torch.multiprocessing.spawn, runtime/spawned.py) from the process
    dprorun launched on one node: the job's world is theirs, and a dry run predicts for it unless asked otherwise.
    Also the manifest's note of the processes launched."""
    from dprorun.runtime.spawned import read_spawned_world_size

    world = read_spawned_world_size(job.output.run_dir) if job.launch.nnodes == 1 else None
    if world is None or world == job.launch.world_size:
        return job, {}
    predict = job.predict
    if predict.np == job.launch.world_size:
        predict = dataclasses.replace(predict, np=world)
    return (dataclasses.replace(job, launch=dataclasses.replace(job.launch, nproc_per_node=world), predict=predict),
            {"launched_processes": job.launch.world_size})


def _failed_before_any_step(job: JobConfig, result: LaunchResult, ranks: list[int]) -> bool:
    """A failed job none of whose ranks recorded a training step (a script raising after hvd.init or after building
    its DDP model, before its first step): nothing to read, align or replay, said so, with what the ranks recorded
    of why (a ParameterServerStrategy under --backend tf, ...; their errors are named above); the files stay."""
    from dprorun.layout import EVENTS_FILE, SCRIPT_RAISED, STOPPED_BY_SIGTERM, rank_dir

    if result.exit_code == 0:
        return False
    said: dict[str, list[int]] = {}
    for rank in ranks:
        try:
            with open(os.path.join(rank_dir(job.output.run_dir, rank), EVENTS_FILE), encoding="utf-8") as handle:
                events = json.load(handle)
        except (OSError, ValueError):
            return False  # the analysis says what it can of a file it cannot read
        if not isinstance(events, dict) or events.get("iteration_starts_us"):
            return False
        for warning in events.get("warnings") or []:
            if isinstance(warning, str) and not warning.startswith(SCRIPT_RAISED) and warning != STOPPED_BY_SIGTERM:
                said.setdefault(warning, []).append(rank)
    for warning, which in said.items():
        print(f"dprorun: warning: rank{'s' if len(which) > 1 else ''} {', '.join(map(str, which))}: {warning}",
              file=sys.stderr)
    print("dprorun: no rank recorded a training step before the failure: nothing to analyse", file=sys.stderr)
    return True


def _outcome_as_json(job: JobConfig, exit_code: int, message: str) -> None:
    """`--json` where no summary is printed (nothing profiled, a failure, no replay): stdout still holds one JSON
    document, the run's outcome, for the script that reads it."""
    if job.output.json_summary:
        print(json.dumps({"run_dir": job.output.run_dir, "job_id": job.profile.job_id, "backend": job.launch.backend,
                          "status": "completed" if exit_code == 0 else "failed", "exit_code": exit_code,
                          "summary": None, "message": message}, indent=2))


def _finish_unanalysed(job: JobConfig, result: LaunchResult, with_events: list[int], horovod: Optional[dict]) -> int:
    """A run with nothing to analyse here (another node's, a failure before any step, nothing profiled): what is
    known said, Horovod's timeline summarised."""
    if horovod is not None:
        atomic_write_json(os.path.join(job.output.run_dir, "summary.json"),
                          {"backend": "horovod", "horovod": horovod}, indent=2)
        if not job.output.quiet and not job.output.json_summary:
            print(_horovod_line(horovod))
    left = _ranks_that_left_files(job) if result.exit_code == 0 and not with_events else []
    if left and job.launch.node_rank == 0:
        print(f"dprorun: warning: ranks {left} left profiler files but no records (events.json): the job ended "
              "past Python's exit handlers (an exit from C code, or a signal) before they were written; what "
              f"they left is kept in {job.output.run_dir}", file=sys.stderr)
    elif result.exit_code == 0 and not with_events and job.launch.node_rank == 0 and \
            job.launch.backend != "byteps":
        _say_nothing_was_profiled(job)
        if job.profile.dry_run:  # the job ran, but what was asked for is a prediction: none without a profile
            print(f"{NO_PREDICTION}nothing was profiled (above); the run directory is kept: "
                  f"{job.output.run_dir}", file=sys.stderr)
            _outcome_as_json(job, 1, "no prediction: nothing was profiled")
            return 1
    _outcome_as_json(job, result.exit_code, result.message if result.exit_code else
                     "nothing was profiled" if not with_events else "not analysed on this node")
    if result.exit_code == 0 and not job.output.quiet and not job.output.json_summary:
        print(f"dprorun: run directory {job.output.run_dir}")
    return result.exit_code


def finalize_run(job: JobConfig, result: LaunchResult) -> int:
    job, spawned = _with_the_scripts_spawned_ranks(job)
    status = "completed" if result.exit_code == 0 else "failed"
    with_events = ranks_with_records(job.output.run_dir)
    extra = {"exit_code": result.exit_code, "message": result.message, "elapsed_s": round(result.elapsed_s, 3),
             "ranks_with_traces": with_events, "failed_rank": result.failed_rank, "relaunches": result.relaunches,
             **spawned}
    for why in result.relaunches:  # said when it happened; again here, where the run's outcome is read
        print(f"dprorun: warning: {why}", file=sys.stderr)
    if job.launch.node_rank == 0:
        try:
            write_manifest(job, status, extra)
        except OSError as exc:  # e.g. the disk filled up: the job's outcome stands, say what is missing
            print(f"dprorun: warning: cannot write {job.output.run_dir}/manifest.json ({exc.strerror}); the run "
                  "directory is incomplete", file=sys.stderr)
    if result.exit_code != 0:
        print(f"dprorun: error: {result.message}", file=sys.stderr)
        missing = sorted(set(range(job.launch.world_size)) - set(with_events))
        kept = f"traces kept for ranks {with_events}" if with_events else "no trace was recorded"
        if missing and with_events:
            kept += f"; missing for ranks {missing}"
        print(f"dprorun: {kept} in {job.output.run_dir}", file=sys.stderr)
    if job.launch.backend == "mxnet" and job.launch.node_rank != 0:
        if not job.output.quiet:
            print(f"dprorun: node {job.launch.node_rank}: traces sent to node 0 (kept in {job.output.run_dir})")
        return result.exit_code
    if job.launch.backend == "mxnet" and with_events:
        return _finalize_ps(job, result, with_events)
    horovod = _horovod_timeline(job) if job.launch.backend == "horovod" and job.launch.node_rank == 0 else None
    if job.launch.node_rank != 0 or not with_events or _failed_before_any_step(job, result, with_events):
        return _finish_unanalysed(job, result, with_events, horovod)
    analysis = RunAnalysis(job.output.run_dir)  # read once, aligned once, replayed once for everything below
    try:  # summary.json and alignment.json are written whatever is printed
        from dprorun.summary import format_summary

        _progress(job, f"reading the traces of {len(with_events)} ranks")
        summary = dict(analysis.summary)
        _progress(job, "aligning clocks")
        summary["alignment"] = _align_at_job_end(analysis)
        _progress(job, "replaying the job as it ran")
        summary["self_check"] = _self_check_at_job_end(analysis)
        summary["backend"] = job.launch.backend
        if horovod is not None:
            summary["horovod"] = horovod
        atomic_write_json(os.path.join(job.output.run_dir, "summary.json"), summary, indent=2)
    except Exception as exc:  # the job's outcome stands; only the summary is missing
        print(f"dprorun: warning: could not summarise the run: {exc}", file=sys.stderr)
        _outcome_as_json(job, result.exit_code, f"could not summarise the run: {exc}")
        return result.exit_code
    _progress(job, "writing report.html")
    _write_report(analysis)
    if job.profile.dry_run and result.exit_code == 0:
        return _print_prediction(job, summary, analysis)
    if job.output.json_summary:
        print(json.dumps(summary, indent=2))
    elif not job.output.quiet:
        print(format_summary(summary))
        if horovod is not None:
            print(_horovod_line(horovod))
        print(f"dprorun: run directory {job.output.run_dir}")
    return result.exit_code
