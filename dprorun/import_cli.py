"""The `dpro import-*` commands: traces recorded by other tools, read into dprorun's model and replayed (a Horovod
timeline, PyTorch profiler traces of one rank or of every rank of a GPU job, BytePS's comm.json files). The
parser that routes to them is offline_cli.build_parser."""
from __future__ import annotations

import argparse
import json
import os
from typing import Optional

from dprorun.fsutil import UnanswerableError
from dprorun.stats import median


def cmd_import_horovod(args: argparse.Namespace) -> int:
    from dprorun.trace.horovod import read_horovod_timeline, timeline_summary
    from dprorun.trace.model import RunTrace

    timeline = read_horovod_timeline(args.timeline)
    summary = timeline_summary(timeline)
    if args.output:
        from dprorun.timeline import write_timeline

        run = RunTrace(run_dir=os.path.dirname(os.path.abspath(args.timeline)),
                       manifest={"world_size": 1, "source": "horovod timeline"}, ranks={0: timeline.trace})
        written = write_timeline(run, args.output)
        summary["chrome_trace"] = written
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    print(f"{args.timeline}: {summary['tensors']} tensors, {summary['steps']} steps"
          + (" (file cut short: complete events only)" if summary["truncated"] else "")
          + (f"; {summary['unfinished_steps_left_out']} unfinished step left out" if
             summary["unfinished_steps_left_out"] else ""))
    print(f"fused responses in the first step: {summary['fused_responses_first_step']} "
          f"(tensors per response: {summary['tensors_per_response']})")
    print(f"{'step':>4} {'span ms':>9} {'negotiate ms':>12} {'queue ms':>9} {'memcpy ms':>9} {'transmit ms':>11}")
    for row in summary["per_step"]:
        print(f"{row['step']:4d} {row['span_ms']:9.2f} {row['negotiate_ms']:12.2f} {row['queue_ms']:9.2f} "
              f"{row['memcpy_ms']:9.2f} {row['transmit_ms']:11.2f}")
    print("(negotiate and queue are summed over tensors, transmission once per fused response)")
    if args.output:
        print(f"wrote {summary['chrome_trace']['events']} events to {args.output}")
    return 0


def parse_stage_scale(text: str) -> dict[str, float]:
    """"PUSH=0.5,PULL=0.5" -> {"PUSH": 0.5, "PULL": 0.5}"""
    out: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        stage, sep, value = item.partition("=")
        try:
            factor = float(value)
        except ValueError:
            factor = -1.0
        if not sep or not stage or factor <= 0:
            raise argparse.ArgumentTypeError(f"expected STAGE=FACTOR[,STAGE=FACTOR...] with FACTOR > 0, got {item!r}")
        out[stage.strip().upper()] = factor
    return out


def cmd_import_kineto(args: argparse.Namespace) -> int:
    """A PyTorch profiler trace (GPU or CPU) as the kernel-level local DFG of each profiled step (graph/kernels.py),
    replayed: measured vs replayed step, how far the replayed GPU ops start from the measured ones, each stream's
    busy time, the critical path, and with --op-scale the what-if."""
    from dprorun.graph.kernels import replay_step
    from dprorun.trace.kineto import read_kineto

    paths, clock = args.traces, ({}, "")
    if len(paths) == 1 and os.path.isdir(paths[0]):  # a run directory: every rank's profiler trace
        paths, clock = _run_dir_kineto_traces(paths[0]), _run_dir_offsets(paths[0])
    if len(paths) > 1:
        return _import_kineto_job(args, paths, [read_kineto(path) for path in paths], clock[0] or None, clock[1])
    if args.rank_scale:
        raise UnanswerableError("--rank-scale asks a job-level what-if: give one trace per rank")
    path = paths[0]
    trace = read_kineto(path)
    steps = [s for s, _, _ in trace.steps if args.step is None or s == args.step]
    if not steps:
        raise UnanswerableError(f"{path}: no ProfilerStep#{args.step if args.step is not None else 'N'} "
                                "annotation (profile with torch.profiler's schedule and call prof.step())")
    op_scale = dict(args.op_scale or [])
    rows = []
    for step in steps:
        as_run = replay_step(trace, step)
        whatif = replay_step(trace, step, op_scale) if op_scale else None
        rows.append({"step": step, "measured_ms": round(as_run.measured_us / 1000, 3),
                     "replayed_ms": round(as_run.replayed_us / 1000, 3),
                     "gpu_start_error_us": round(as_run.start_error_us, 1),
                     "gpu_busy_ms": {d: round(us / 1000, 3) for d, us in as_run.gpu_busy_us.items()},
                     "critical_path": as_run.critical_path, "notes": as_run.notes,
                     **({"whatif_ms": round(whatif.replayed_us / 1000, 3)} if whatif else {})})
    if args.json:
        print(json.dumps({"trace": path, "op_scale": op_scale, "steps": rows}, indent=2))
        return 0
    print(f"{path}: {len(trace.gpu)} GPU ops on {len({op.stream for op in trace.gpu})} stream(s), "
          f"{len(trace.runtime)} CUDA runtime calls; each step replayed as its kernel-level DFG")
    for row in rows:
        busy = ", ".join(f"{d.split('.', 1)[1]} {ms:.2f} ms" for d, ms in row["gpu_busy_ms"].items()) or "no GPU ops"
        print(f"  step {row['step']}: measured {row['measured_ms']:.2f} ms, replayed {row['replayed_ms']:.2f} ms "
              f"(GPU ops start {row['gpu_start_error_us']:.1f} us from their measured starts, median); busy: {busy}"
              + (f"; what-if {row['whatif_ms']:.2f} ms" if "whatif_ms" in row else ""))
        _print_warnings(row["notes"])
    for note in rows[-1]["notes"]:
        if not note.startswith("warning"):
            print(f"  note: {note}")
    _print_step_path(rows[-1])
    return 0


def _print_warnings(notes: list[str]) -> None:
    for note in notes:
        if note.startswith("warning"):
            print(f"    {note}")


def _print_step_path(row: dict) -> None:
    """The critical path of one replayed profiler step (import-kineto), its top ops."""
    top = row["critical_path"]
    print(f"critical path of step {row['step']} ({top['share_pct']}):")
    for item in top["top"][:8]:
        print(f"  {item['time_on_path_ms']:8.2f} ms  {item['op']}")


def _run_dir_kineto_traces(run_dir: str) -> list[str]:
    """RUN_DIR/rank_K/kineto_trace.json of every rank that has one, in rank order."""
    from dprorun.layout import KINETO_FILE, rank_folders

    paths = [os.path.join(folder, KINETO_FILE) for folder in rank_folders(run_dir).values()]
    paths = [p for p in paths if os.path.exists(p)]
    if not paths:
        raise UnanswerableError(f"{run_dir}: no rank_K/{KINETO_FILE} (the profiler's traces; a run made with "
                                "--no-kineto has none)")
    return paths


def _run_dir_offsets(run_dir: str) -> tuple[dict[int, float], str]:
    """The run's own clock offsets (alignment.json: its probes and collectives, solved at job end), if written."""
    from dprorun.layout import ALIGNMENT_FILE

    path = os.path.join(run_dir, ALIGNMENT_FILE)
    try:
        with open(path) as handle:
            doc = json.load(handle)
        return {int(r): float(v) for r, v in doc["offsets_us"].items()}, f"the run's alignment ({ALIGNMENT_FILE})"
    except (OSError, ValueError, KeyError, TypeError):
        return {}, ""


def _import_kineto_job(args: argparse.Namespace, paths: list[str], traces: list,
                       offsets_us: Optional[dict[int, float]], clock_source: str) -> int:
    """Several ranks' traces: each common profiled step as the kernel-level global DFG (graph/kernels.py
    job_kernel_dfg), replayed; with --op-scale / --rank-scale the what-if."""
    from dprorun.graph.kernels import replay_job_step

    common = set.intersection(*({s for s, _, _ in t.steps} for t in traces))
    steps = sorted(s for s in common if args.step is None or s == args.step)
    if not steps:
        raise UnanswerableError("no ProfilerStep#N " + (f"{args.step} " if args.step is not None else "")
                                + "is in every trace: " + "; ".join(f"{t.path}: {[s for s, _, _ in t.steps]}"
                                                                    for t in traces))
    op_scale, rank_scale = dict(args.op_scale or []), dict(args.rank_scale or [])
    rows, skipped = [], []
    for step in steps:
        try:
            as_run = replay_job_step(traces, step, clock_offsets_us=offsets_us, clock_source=clock_source)
        except UnanswerableError as exc:
            if args.step is not None:
                raise
            skipped.append(str(exc))  # e.g. the profiler's last, cut-short step: the others still answer
            continue
        row = as_run.to_json()
        if op_scale or rank_scale:
            row["whatif_ms"] = round(replay_job_step(traces, step, op_scale, rank_scale, offsets_us,
                                                     clock_source).replayed_us / 1000, 3)
        rows.append(row)
    if not rows:
        raise UnanswerableError("; ".join(skipped))
    if args.json:
        print(json.dumps({"traces": paths, "op_scale": op_scale,
                          "rank_scale": {str(r): f for r, f in rank_scale.items()}, "steps": rows,
                          "skipped": skipped}, indent=2))
        return 0
    print(f"{len(traces)} ranks ({', '.join(str(r) for r in rows[0]['ranks'])}): each step replayed as one "
          "kernel-level global DFG, the ranks joined through their collectives (NCCL kernels, or gloo's on its "
          "threads)")
    for row in rows:
        waited = ", ".join(f"rank {r} {m:.2f}/{p:.2f} ms" for r, m, p in zip(
            row["ranks"], row["waited_in_collectives_ms"]["measured"], row["waited_in_collectives_ms"]["replayed"]))
        print(f"  step {row['step']}: measured {row['measured_ms']:.2f} ms, replayed {row['replayed_ms']:.2f} ms "
              f"({row['collectives']} collectives; waited for peers, measured/replayed: {waited}; GPU ops start "
              f"{max(row['gpu_start_error_us']):.1f} us from their measured starts, worst rank's median)"
              + (f"; what-if {row['whatif_ms']:.2f} ms" if "whatif_ms" in row else ""))
        _print_warnings(row["notes"])
    for reason in skipped:
        print(f"  skipped: {reason}")
    for note in rows[-1]["notes"]:
        if note.startswith("clocks"):
            print(f"  note: {note}")
    _print_step_path(rows[-1])
    return 0


def cmd_import_byteps(args: argparse.Namespace) -> int:
    from dprorun.replay.pipeline import machine_summary, pipeline_summary
    from dprorun.trace.byteps import read_byteps_comm
    from dprorun.trace.model import RunTrace

    traces = [read_byteps_comm(path, rank=k) for k, path in enumerate(args.comm_json)]
    docs = [pipeline_summary(bt, args.stage_scale) for bt in traces]
    machine = None
    if len(traces) > 1:
        try:
            machine = machine_summary(traces, args.stage_scale)
        except ValueError as exc:  # not one machine's files: each file stands alone
            machine = {"error": str(exc)}
    if args.output:
        from dprorun.timeline import write_timeline

        run = RunTrace(run_dir=os.path.dirname(os.path.abspath(args.comm_json[0])),
                       manifest={"world_size": len(traces), "source": "byteps comm.json"},
                       ranks={bt.trace.rank: bt.trace for bt in traces})
        written = write_timeline(run, args.output)
        for doc in docs:
            doc["chrome_trace"] = written
    if args.json:
        print(json.dumps({"gpus": docs, "machine": machine} if len(docs) > 1 else docs[0], indent=2))
        return 0
    for doc in docs:
        print(f"{doc['path']}: {doc['role']} GPU, {doc['tensors']} tensor(s), "
              f"{sum(doc['partitions'].values())} partitions, {doc['steps']} steps"
              + (" (file cut short: complete events only)" if doc["truncated"] else ""))
        print(f"  {'stage':<22} {'service ms':>10} {'queued ms':>10} {'% of step':>9}   (per step, medians; "
              "queued: summed over partitions)")
        for row in doc["stages"]:
            print(f"  {row['stage']:<22} {row['service_ms']:10.2f} {row['waiting_ms']:10.2f} "
                  f"{row['busy_pct_of_step']:9.1f}")
        print(f"  bottleneck stage: {doc['bottleneck']}")
        for note in doc["notes"]:
            print(f"  note: {note}")
        loo = doc["leave_one_out_error_pct"]
        print(f"  sync time per step: measured median {median(doc['measured_sync_ms']):.2f} ms; replayed from "
              f"the other steps' medians: median {median(doc['predicted_sync_ms']):.2f} ms "
              f"(per-step error median {loo['median']:.2f} %, max {loo['max']:.2f} %)")
        if "whatif" in doc:
            _print_stage_whatif(doc["whatif"])
    if machine is not None and "error" in machine:
        print(f"the files together: {machine['error']}")
    elif machine is not None:
        loo = machine["leave_one_out_error_pct"]
        print(f"the {machine['gpus']} GPUs together (one machine; the others wait for the root's PULLs: "
              f"{'/'.join(str(n) for n in machine['linked_partitions'])} partitions linked): sync time per step "
              f"measured median {median(machine['measured_sync_ms']):.2f} ms, replayed "
              f"{median(machine['predicted_sync_ms']):.2f} ms (per-step error median {loo['median']:.2f} %, "
              f"max {loo['max']:.2f} %)")
        if "whatif" in machine:
            _print_stage_whatif(machine["whatif"])
    if args.output:
        print(f"wrote {docs[0]['chrome_trace']['events']} events to {args.output}")
    return 0


def _print_stage_whatif(whatif: dict) -> None:
    scale = ", ".join(f"{k} x{v:g}" for k, v in whatif["stage_scale"].items())
    print(f"  what-if ({scale}): {whatif['as_run_sync_ms']:.2f} -> {whatif['predicted_sync_ms']:.2f} ms")
    for note in whatif.get("notes", []):
        print(f"  note: {note}")
