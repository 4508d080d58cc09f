"""`dpro`: offline analysis of a run directory (no GPU, no job needed)."""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional, Sequence

from dprorun import __version__
from dprorun.argtypes import non_negative_float, positive_float, positive_int
from dprorun.analysis import RunAnalysis, optimize_run
from dprorun.fsutil import TraceError, UnanswerableError
from dprorun.procs import StdoutThatOutlivesItsReader
from dprorun.import_cli import cmd_import_byteps, cmd_import_horovod, cmd_import_kineto, parse_stage_scale


def _cmd_summary(args: argparse.Namespace) -> int:
    from dprorun.summary import format_summary, summarize_run

    summary = summarize_run(args.run_dir)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(format_summary(summary))
    return 0


def load_aligned(run_dir: str):
    """The run on the reference clock and its alignment (read and solved once; alignment.json rewritten)."""
    analysis = RunAnalysis(run_dir)
    return analysis.aligned_run, analysis.alignment


def _cmd_align(args: argparse.Namespace) -> int:
    _, alignment = load_aligned(args.run_dir)
    doc = alignment.to_json()
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    print(f"clock alignment of {args.run_dir} ({alignment.method}, {alignment.solve_time_s:.2f} s"
          + (", APPROXIMATE" if alignment.approximate else "") + ")")
    for rank, offset in doc["offsets_us"].items():
        interval = doc["probe_intervals_us"].get(rank)
        probe = f"   probe interval [{interval[0]:.1f}, {interval[1]:.1f}]" if interval else ""
        width = doc["uncertainty_us"].get(rank)
        known = "unbounded" if width is None else f"{width:.1f} us"
        print(f"  rank {rank}: {offset:+.1f} us   uncertainty {known}{probe}")
    print(f"causality violations: {alignment.violations_before} before, {alignment.violations_after} after "
          f"alignment (of {alignment.pairs_checked} cross-rank dependencies)")
    for warning in alignment.warnings:
        print(f"warning: {warning}")
    return 0


def _cmd_graph(args: argparse.Namespace) -> int:
    """The global DFG that `dpro replay` replays (the job as it ran, at op level, and its coarsened view), or with
    --measured the trace view of one profiled iteration (measured times, SEND/RECV transaction ids)."""
    if args.measured:
        from dprorun.graph.build import build_global_dfg

        run, _ = load_aligned(args.run_dir)
        dfg = build_global_dfg(run, args.iteration)
        report = {"stats": dfg.stats(), "problems": dfg.check(), "notes": dfg.notes}
        if not report["problems"]:
            report["replay"] = measured_replay(run, dfg)
        print(json.dumps(report, indent=2))
        return 0 if not report["problems"] else 1
    from dprorun.analysis import RunAnalysis
    from dprorun.replay.coarsen import coarsen
    from dprorun.replay.engine import critical_path_report, replay
    from dprorun.replay.synthesize import synthesize
    from dprorun.replay.whatif import WhatIf

    model = RunAnalysis(args.run_dir).model
    notes: list[str] = []
    graph = synthesize(model, WhatIf(), notes)
    result = replay(graph)
    coarse = coarsen(graph)
    path = critical_path_report(graph, result, top=10)
    report = {"graph": graph.stats(), "coarsened": coarse.stats(),
              "iteration_time_ms": {"op_level": round(result.iteration_time_us / 1000, 4),
                                    "coarsened": round(replay(coarse).iteration_time_us / 1000, 4)},
              "critical_path": {"length": path["length"], "top": path["top"]},
              "op_scaling": model.op_scaling, "notes": notes}
    print(json.dumps(report, indent=2))
    return 0


def measured_replay(run, dfg) -> dict:
    """The measured DFG replayed by the engine, beside the iteration it was measured on (per rank: its span and
    its compute ops' busy time; the difference is the gaps between the profiler's top-level ops and waits)."""
    from dprorun.graph.build import replay_graph
    from dprorun.replay.engine import critical_path_report, replay
    from dprorun.trace.model import OpKind

    graph = replay_graph(dfg)
    result = replay(graph)
    iteration = next(op.iteration for op in dfg.nodes)
    spans, busy = {}, {}
    for rank, trace in sorted(run.ranks.items()):
        span = [e - s for i, s, e in trace.iterations if i == iteration]
        spans[str(rank)] = round(span[0] / 1000, 4) if span else None
        busy[str(rank)] = round(sum(op.end_us - op.start_us for op in dfg.nodes if op.rank == rank and op.kind
                                    in (OpKind.FW, OpKind.BW, OpKind.UPDATE, OpKind.IO, OpKind.OTHER)) / 1000, 4)
    path = critical_path_report(graph, result, top=5)
    return {"iteration": iteration, "iteration_time_ms": round(result.iteration_time_us / 1000, 4),
            "measured_span_ms": spans, "compute_busy_ms": busy, "critical_path_top": path["top"],
            "note": "the measured ops with their dependencies, replayed by the engine that replays the synthesized "
                    "graph; the measured span also holds the gaps between the profiler's top-level ops"}


def _cmd_timeline(args: argparse.Namespace) -> int:
    from dprorun.replay.ps_model import is_ps_run
    from dprorun.timeline import write_hta_dir, write_timeline

    if is_ps_run(args.run_dir):  # one host, one clock: the workers' and servers' records as they are
        from dprorun.fsutil import atomic_write_json
        from dprorun.timeline import ps_chrome_trace

        doc = ps_chrome_trace(args.run_dir)
        atomic_write_json(args.output, doc)
        meta = doc["metadata"]
        print(f"wrote {len(doc['traceEvents'])} events to {args.output} ({meta['workers']} workers, "
              f"{meta['servers']} servers, {meta['keyed_pushpulls']} push/pulls with their key: push -> server "
              "update -> pull as flow arrows); open it in https://ui.perfetto.dev or chrome://tracing")
        return 0

    run, alignment = load_aligned(args.run_dir)
    out = write_timeline(run, args.output)
    print(f"wrote {out['events']} events to {out['path']} (aligned: {alignment.method}); open it in "
          "https://ui.perfetto.dev or chrome://tracing")
    if args.hta_dir:
        files = write_hta_dir(run, args.hta_dir)
        print(f"wrote {len(files)} per-rank Kineto-format files to {args.hta_dir} (Holistic Trace Analysis)")
    return 0


def parse_bandwidth(text: str) -> float:
    """'10Gbit', '1gbit', '100Mbit', '25Gbps', '0.5' (Gbit/s) -> Gbit/s."""
    import re

    match = re.fullmatch(r"\s*([0-9.]+)\s*([kmg]?)(bit|bps|b/s)?(/s)?\s*", text.lower())
    if not match:
        raise argparse.ArgumentTypeError(f"bandwidth {text!r}: expected e.g. 10Gbit, 100Mbit")
    value = float(match.group(1))
    if value <= 0:
        raise argparse.ArgumentTypeError(f"bandwidth {text!r}: must be above 0")
    unit = match.group(2) or "g"
    return value * {"k": 1e-6, "m": 1e-3, "g": 1.0}[unit]


def parse_host_cores(text: str) -> int:
    """--host-cores: "auto" (-1: the cores the hooks recorded) or a positive count."""
    if text == "auto":
        return -1
    try:
        cores = int(text)
    except ValueError:
        cores = 0
    if cores < 1:
        raise argparse.ArgumentTypeError(f"'auto' or a positive number of cores, not {text!r}")
    return cores


def _cmd_replay_ps(args: argparse.Namespace) -> int:
    """A parameter-server run (--backend mxnet): its PS graph replayed, with the PS what-ifs."""
    from dprorun.replay.ps import PSWhatIf, format_ps_prediction, predict_ps
    from dprorun.replay.ps_model import build_ps_model

    model = build_ps_model(args.run_dir, args.host_cores)
    whatif = PSWhatIf(servers=args.servers, bigarray_bound=args.bigarray_bound, workers=args.np,
                      bandwidth_scale=args.bandwidth_scale, bandwidth_gbit=args.bandwidth, links=args.links)
    prediction = predict_ps(model, whatif)
    if args.json:
        print(json.dumps({**prediction.to_json(), "model": model.to_json()}, indent=2, default=float))
    else:
        print(format_ps_prediction(model, prediction))
    return 0


def _cmd_replay(args: argparse.Namespace) -> int:
    from dprorun.replay.ps_model import is_ps_run

    if is_ps_run(args.run_dir):
        return _cmd_replay_ps(args)
    if (args.servers is not None or args.bigarray_bound is not None or args.links is not None
            or args.host_cores is not None):
        raise argparse.ArgumentTypeError("--servers, --bigarray-bound, --links and --host-cores are parameter-server "
                                         "options (runs of dprorun --backend mxnet)")
    from dprorun.fsutil import atomic_write_json
    from dprorun.replay.engine import execution_graph, replay_chrome_trace
    from dprorun.replay.predict import predict_replayed
    from dprorun.replay.build import build_job_model
    from dprorun.replay.whatif import WhatIf

    run, alignment = load_aligned(args.run_dir)
    model = build_job_model(run)
    whatif = _replay_whatif(args, model)
    detail = "coarse" if args.coarse else "ops"
    prediction, graph, result = predict_replayed(model, whatif, detail)
    as_run = predict_replayed(model, WhatIf(), detail)[0] if whatif.op_scale else None
    for path, build in ((args.exec_graph, execution_graph), (args.chrome_trace, replay_chrome_trace)):
        if path:
            atomic_write_json(path, build(graph, result))
            print(f"wrote {path}", file=sys.stderr)
    doc = prediction.to_json()
    doc["alignment"] = {"method": alignment.method, "approximate": alignment.approximate,
                        "max_uncertainty_us": alignment.max_uncertainty_us()}
    if as_run is not None:
        doc["as_run_ms"] = as_run.predicted_iteration_time_ms
    from dprorun.graph.kernels import kernel_level_of_run

    kernel_level = kernel_level_of_run(run, alignment.offsets_us, f"the run's alignment ({alignment.method})")
    if kernel_level is not None:
        doc["kernel_level"] = kernel_level
    if args.json:
        print(json.dumps(doc, indent=2, default=float))
        return 0
    _print_replay(prediction, as_run)
    if kernel_level and kernel_level["steps"]:
        steps = kernel_level["steps"]
        print(f"kernel level: {len(steps)} profiled step(s) replayed with every rank's CPU threads, CUDA calls and "
              f"GPU streams, joined through their collectives: "
              + ", ".join(f"{s['measured_ms']:.2f} -> {s['replayed_ms']:.2f} ms" for s in steps)
              + f" (median |error| {kernel_level['median_abs_error_pct']:.1f} %; per step: dpro import-kineto "
              f"{args.run_dir})")
    return 0


def _replay_whatif(args: argparse.Namespace, model):
    """dpro replay's flags as one WhatIf; compute variants (--compile, --compile-blocks, --bf16) at the ratios
    the run measured."""
    from dprorun.optimize.search import compiled_ready_groups
    from dprorun.replay.whatif import WhatIf

    forward_scale = backward_scale = 1.0
    if args.compile and args.compile_blocks:
        raise argparse.ArgumentTypeError("--compile (the whole model) and --compile-blocks (each block) are "
                                         "alternatives")
    for wanted, variant in ((args.compile, "compiled"), (args.compile_blocks, "compiled_blocks"), (args.bf16, "bf16")):
        if not wanted:
            continue
        scales = model.compute_scales(variant)
        if scales is None:
            error = model.compute_variants.get(variant, {}).get("error")
            raise TraceError(args.run_dir, f"no measured {variant} timings" + (f" ({error})" if error else
                             ": profile with dprorun --measure-variants"))
        forward_scale, backward_scale = forward_scale * scales[0], backward_scale * scales[1]
    compiled = "compiled" if args.compile else "compiled_blocks" if args.compile_blocks else None
    return WhatIf(world_size=args.np, bandwidth_gbit=args.bandwidth, bandwidth_scale=args.bandwidth_scale,
                  latency_us=args.latency_us, bucket_mb=args.bucket_mb, partitions=args.partitions,
                  horovod_fusion_mb=args.horovod_fusion_mb, horovod_cycle_ms=args.horovod_cycle_ms,
                  baseline=args.baseline, forward_scale=forward_scale, backward_scale=backward_scale,
                  ready_groups=compiled_ready_groups(model, compiled, model.fusion_blocks()),
                  op_scale=dict(args.op_scale or []))


def _print_replay(prediction, as_run) -> None:
    """dpro replay's terminal output: the prediction, its check against the run, the critical path."""
    spread = (f", p10-p90 {prediction.spread_ms[0]:.3f}-{prediction.spread_ms[1]:.3f}" if prediction.spread_ms
              else "")
    print(f"predicted iteration time: {prediction.predicted_iteration_time_ms:.3f} ms{spread} "
          f"({prediction.world_size} ranks, {prediction.buckets} buckets, {prediction.baseline} replay of "
          f"{prediction.replay_ops} ops in {prediction.replay_time_s * 1000:.1f} ms)")
    if prediction.self_check is not None and prediction.self_check["status"] == "agrees":
        print(prediction.self_check["message"])
    if as_run is not None:
        gain = 100 * (1 - prediction.predicted_iteration_time_ms / as_run.predicted_iteration_time_ms)
        print(f"the job as it ran: {as_run.predicted_iteration_time_ms:.3f} ms; with the scaled ops "
              f"{prediction.predicted_iteration_time_ms:.3f} ms ({gain:.1f} % faster)")
    if prediction.measured_iteration_time_ms is not None:
        error = 100 * (prediction.predicted_iteration_time_ms / prediction.measured_iteration_time_ms - 1)
        print(f"measured iteration time:  {prediction.measured_iteration_time_ms:.3f} ms ({error:+.1f} %)")
    share = prediction.critical_path["share_pct"]
    print(f"critical path: {prediction.critical_path['length']} ops; compute {share['compute']:.1f} %, "
          f"communication {share['communication']:.1f} %, queueing {share['queueing']:.1f} %")
    for row in prediction.critical_path["top"][:10]:
        print(f"  {row['time_on_path_ms']:9.3f} ms  {row['kind']:7} rank {row['rank']:<3} {row['op']}")
    busiest = sorted(prediction.device_utilisation.items(), key=lambda kv: -kv[1])[:6]
    print("device utilisation: " + ", ".join(f"{name} {100 * share:.0f} %" for name, share in busiest))
    comm = prediction.comm_model
    print(f"comm model: {comm['collective_us']:.1f} us per collective + {comm['alpha_us']:.1f} us per ring step + "
          f"bytes at {comm['bandwidth_gbit_s']:.3f} Gbit/s ({comm['source']})")
    for note in prediction.notes:
        print(f"note: {note}")


def parse_op_scale(text: str) -> tuple[str, float]:
    """'aten::linear=0.5' -> ('aten::linear', 0.5)."""
    pattern, sep, factor = text.rpartition("=")
    try:
        value = float(factor)
    except ValueError:
        value = -1.0
    if not sep or not pattern or value < 0:
        raise argparse.ArgumentTypeError(f"op scale {text!r}: expected PATTERN=FACTOR with FACTOR >= 0, "
                                         "e.g. aten::linear=0.5")
    return pattern, value


def parse_rank_scale(text: str) -> tuple[int, float]:
    """'1=1.5' -> (1, 1.5)."""
    rank, sep, factor = text.partition("=")
    try:
        parsed = (int(rank), float(factor))
    except ValueError:
        parsed = (-1, -1.0)
    if not sep or parsed[0] < 0 or parsed[1] <= 0:
        raise argparse.ArgumentTypeError(f"rank scale {text!r}: expected RANK=FACTOR with FACTOR > 0, e.g. 1=1.5")
    return parsed


def parse_bytes(text: str) -> int:
    """'8GiB', '512MiB', '1.5GB', '1000000' -> bytes."""
    import re

    match = re.fullmatch(r"\s*([0-9.]+)\s*([kmgt]?)(i?)b?\s*", text.lower())
    if not match:
        raise argparse.ArgumentTypeError(f"memory size {text!r}: expected e.g. 8GiB, 512MiB")
    power = " kmgt".index(match.group(2) or " ")
    return int(float(match.group(1)) * (1024 if match.group(3) or power else 1000) ** power)


def _cmd_optimize(args: argparse.Namespace) -> int:
    from dprorun.optimize import BudgetError
    from dprorun.strategy import save_strategy, strategy_json

    try:
        strategy, _ = optimize_run(args.run_dir, args.memory_budget, args.allow_bf16,
                                   {"auto": None, "on": True, "off": False}[args.comm_passes])
    except BudgetError as exc:
        print(f"dpro: error: {exc}", file=sys.stderr)
        return 3
    out = args.output or os.path.join(args.run_dir, "strategy.json")
    save_strategy(strategy, out)
    if args.json:
        print(strategy_json(strategy))
        return 0
    for line in strategy.summary_lines():
        print(line)
    search = strategy.search
    for key, what in (("comm_passes", "communication"), ("partitions", "partition"),
                      ("compute_passes", "op fusion and bf16")):
        if key in search:
            print(f"{what} passes {search[key]}")
    print(f"search: {search['evaluations']} replays in {search['seconds']:.2f} s; strategy written to {out}")
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from dprorun.report import format_report, write_report

    path, data = write_report(RunAnalysis(args.run_dir), args.output)
    if args.json:
        print(json.dumps(data, indent=2, default=float))
        return 0
    print(format_report(data))
    print(f"report written to {path} (self-contained HTML: open it in a browser)")
    return 0


def _replay_arguments(rp: argparse.ArgumentParser) -> None:
    """dpro replay's what-ifs: world size, links, buckets and partitions, op scales, Horovod knobs, compute
    variants, parameter-server layout; and its outputs."""
    rp.add_argument("run_dir")
    rp.add_argument("--np", type=positive_int, default=None, help="world size to predict")
    rp.add_argument("--bandwidth", type=parse_bandwidth, default=None, help="link bandwidth, e.g. 10Gbit")
    rp.add_argument("--bandwidth-scale", type=positive_float, default=1.0, help="multiply the measured bandwidth")
    rp.add_argument("--servers", type=positive_int, default=None,
                    help="parameter-server runs: number of servers (keys placed as MXNet's kvstore does)")
    rp.add_argument("--bigarray-bound", type=positive_int, default=None,
                    help="parameter-server runs: MXNET_KVSTORE_BIGARRAY_BOUND (elements from which a key is split "
                         "over every server)")
    rp.add_argument("--links", choices=("per-node", "shared", "hosts"), default=None,
                    help="parameter-server runs: a link per worker and server, one medium for all (the default), "
                    "or a NIC and a loopback per host (roles on several hosts)")
    rp.add_argument("--host-cores", type=parse_host_cores, default=None, metavar="N|auto",
                    help="parameter-server runs: model each host's cores as shared by its workers' compute, loopback "
                         "and servers (auto: the cores the hooks recorded), fitted and replayed so; off by default")
    rp.add_argument("--latency-us", type=non_negative_float, default=None, help="per ring step latency")
    rp.add_argument("--bucket-mb", type=positive_float, default=None,
                    help="regroup gradients into buckets of this size")
    rp.add_argument("--partitions", type=positive_int, default=1, help="split each bucket's sync into k pieces")
    rp.add_argument("--op-scale", type=parse_op_scale, action="append", metavar="PATTERN=FACTOR",
                    help="scale the profiled ops whose name, module scope or name@scope matches the glob PATTERN "
                         "(e.g. 'aten::linear=0.5', 'encoder.layers.3*=0.8', '*Backward0@head=0'); repeatable")
    rp.add_argument("--coarse", action="store_true",
                    help="replay the coarsened view (one op per compute phase) instead of the op-level graph")
    rp.add_argument("--horovod-fusion-mb", type=non_negative_float, default=None,
                    help="Horovod runs: fusion threshold to predict for (0: no fusion)")
    rp.add_argument("--horovod-cycle-ms", type=positive_float, default=None,
                    help="Horovod runs: cycle time to predict for")
    rp.add_argument("--compile", action="store_true",
                    help="torch.compile of the model, at the compiled/eager ratios measured by --measure-variants")
    rp.add_argument("--compile-blocks", action="store_true",
                    help="torch.compile of each of the model's blocks, at the ratios measured by --measure-variants")
    rp.add_argument("--bf16", action="store_true", help="bf16 autocast, at its measured ratios (--measure-variants)")
    rp.add_argument("--baseline", choices=("dpro", "daydream"), default="dpro")
    rp.add_argument("--exec-graph", metavar="FILE", help="write the execution graph (ops as replayed, DFG and "
                    "same-device ordering edges, the critical path) as JSON")
    rp.add_argument("--chrome-trace", metavar="FILE", help="write the replayed iteration as a Chrome trace "
                    "(a process per rank, a thread per device; open in Perfetto)")
    rp.add_argument("--json", action="store_true")
    rp.set_defaults(func=_cmd_replay)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dpro", description="Analyse a dprorun run directory.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    summary = sub.add_parser("summary", help="per-rank iteration time and compute/communication breakdown")
    summary.add_argument("run_dir")
    summary.add_argument("--json", action="store_true", help="print the summary as JSON")
    summary.set_defaults(func=_cmd_summary)
    al = sub.add_parser("align", help="solve per-rank clock offsets (cvxpy) and count causality violations")
    al.add_argument("run_dir")
    al.add_argument("--json", action="store_true")
    al.set_defaults(func=_cmd_align)
    graph = sub.add_parser("graph", help="the global dataflow graph that is replayed (op level and coarsened), "
                                         "or with --measured one profiled iteration's trace view, checked")
    graph.add_argument("run_dir")
    graph.add_argument("--measured", action="store_true",
                       help="the measured DFG of one profiled iteration (SEND/RECV transaction ids), checked")
    graph.add_argument("--iteration", type=int, default=None, help="with --measured: the iteration")
    graph.set_defaults(func=_cmd_graph)
    tl = sub.add_parser("timeline", help="export the aligned global timeline as Chrome-trace JSON")
    tl.add_argument("run_dir")
    tl.add_argument("-o", "--output", required=True)
    tl.add_argument("--hta-dir", default=None, help="also write per-rank Kineto-format files for HTA")
    tl.set_defaults(func=_cmd_timeline)
    _replay_arguments(sub.add_parser("replay", help="predict the iteration time (and what-ifs) by replaying the "
                                                   "global DFG"))
    op = sub.add_parser("optimize", help="search the fastest strategy (tensor fusion/partition, memory passes)")
    op.add_argument("run_dir")
    op.add_argument("--memory-budget", type=parse_bytes, default=None, help="per-rank peak memory, e.g. 8GiB")
    op.add_argument("--allow-bf16", action="store_true",
                    help="let the search choose bf16 autocast (it changes the training's numerics)")
    op.add_argument("--comm-passes", choices=("auto", "on", "off"), default="auto",
                    help="tensor fusion / partition: auto leaves them out where the job's CPU transport shares the "
                    "cores its ranks compute on (the replay does not model that cost)")
    op.add_argument("-o", "--output", default=None, help="strategy file (default RUN_DIR/strategy.json)")
    op.add_argument("--json", action="store_true", help="print the strategy as JSON")
    op.set_defaults(func=_cmd_optimize)
    rep = sub.add_parser("report", help="HTML report (timeline, critical path, what-if plots) + terminal summary")
    rep.add_argument("run_dir")
    rep.add_argument("-o", "--output", default=None, help="HTML file (default RUN_DIR/report.html)")
    rep.add_argument("--json", action="store_true", help="print the report's data as JSON")
    rep.set_defaults(func=_cmd_report)
    hv = sub.add_parser("import-horovod", help="read a Horovod timeline file (from any horovodrun job)")
    hv.add_argument("timeline")
    hv.add_argument("-o", "--output", default=None, help="also write it as a Chrome trace in dprorun's model")
    hv.add_argument("--json", action="store_true")
    hv.set_defaults(func=cmd_import_horovod)
    kt = sub.add_parser("import-kineto", help="replay a PyTorch profiler trace's steps as kernel-level DFGs (CPU "
                        "threads, CUDA runtime calls, GPU streams), with per-op what-ifs; given one trace per rank "
                        "of a GPU job, the ranks joined through their NCCL kernels (one global DFG per step)")
    kt.add_argument("traces", nargs="+", metavar="trace",
                    help="Kineto traces (.json or .json.gz), e.g. RUN_DIR/rank_*/kineto_trace.json")
    kt.add_argument("--step", type=int, default=None, help="one ProfilerStep#N (default: every step)")
    kt.add_argument("--op-scale", type=parse_op_scale, action="append", metavar="PATTERN=FACTOR",
                    help="what-if: ops or kernels whose name matches x FACTOR (repeatable), e.g. '*gemm*=0.5'")
    kt.add_argument("--rank-scale", type=parse_rank_scale, action="append", metavar="RANK=FACTOR",
                    help="what-if (several traces): that rank's GPU compute x FACTOR, e.g. 1=1.5 (a slower GPU)")
    kt.add_argument("--json", action="store_true")
    kt.set_defaults(func=cmd_import_kineto)
    bp = sub.add_parser("import-byteps", help="read BytePS comm.json files (BYTEPS_TRACE_ON=1): per-stage service "
                        "and queueing, and a replay of the partition pipeline (with stage what-ifs)")
    bp.add_argument("comm_json", nargs="+", help="comm.json (or .json.gz), one per GPU")
    bp.add_argument("--stage-scale", type=parse_stage_scale, default=None, metavar="STAGE=F[,...]",
                    help="what-if: multiply these stages' service times, e.g. PUSH=0.5,PULL=0.5")
    bp.add_argument("-o", "--output", default=None, help="also write them as a Chrome trace in dprorun's model")
    bp.add_argument("--json", action="store_true")
    bp.set_defaults(func=cmd_import_byteps)
    return parser


def _optimize_ps(args: argparse.Namespace, model) -> int:
    """dpro optimize on a parameter-server run: MXNET_KVSTORE_BIGARRAY_BOUND ranked by replay (optimize/ps.py);
    the best goes to strategy.json (`dprorun --strategy FILE --backend mxnet` runs with it)."""
    from dprorun.optimize.ps import rank_ps_knobs, server_threads_candidate
    from dprorun.strategy import Strategy, save_strategy, strategy_json

    candidates = rank_ps_knobs(model)
    threads = server_threads_candidate(model, candidates[0] if candidates else None)
    strategy = candidates[0] if candidates else Strategy(search={"framework": "mxnet"})
    strategy.source_run = os.path.abspath(args.run_dir)
    out = args.output or os.path.join(args.run_dir, "strategy.json")
    save_strategy(strategy, out)
    if args.json:
        print(strategy_json(strategy))
        return 0
    measured_only = ("" if threads is None else
                     f"; to measure: {threads.decisions[0].choice} ({threads.decisions[0].note}; `--autotune` "
                     "tries it in a trial window)")
    if not candidates:
        print(f"no server count or big-array bound beats the job's own ({model.servers} servers, bound "
              f"{model.bigarray_bound}) by 1 % in the replay; strategy "
              f"(nothing to change) written to {out}{measured_only}")
        return 0
    if measured_only:
        print(measured_only[2:])
    for k, candidate in enumerate(candidates, start=1):
        decision = candidate.decisions[0]
        print(f"{k}. {decision.choice}: {decision.before_ms:.2f} -> {decision.after_ms:.2f} ms ({decision.note})")
    print(f"strategy ({candidates[0].decisions[0].choice}) written to {out}; `dprorun --backend mxnet --strategy "
          f"{out} ...` runs with it, `--autotune` measures the top two")
    return 0


def _align_ps(run_dir: str, as_json: bool) -> int:
    """A PS run's clocks: one host's roles share its clock; across hosts, each node's offset from node 0's as its
    dprorun measured it before the roles started (node_clocks.json), with half the fastest round trip as the
    uncertainty; other hosts' folders are read shifted by it."""
    from dprorun.fsutil import read_json
    from dprorun.layout import NODE_CLOCKS_FILE

    path = os.path.join(run_dir, NODE_CLOCKS_FILE)
    nodes = read_json(path).get("nodes", {}) if os.path.exists(path) else {}
    if as_json:
        print(json.dumps({"nodes": nodes, "offsets_us": {k: v.get("offset_us") for k, v in nodes.items()},
                          "uncertainty_us": {k: v.get("uncertainty_us") for k, v in nodes.items()}}, indent=2))
        return 0
    if not nodes:
        print("parameter-server run on one host: every worker and server stamps time.time_ns on the same clock; "
              "nothing to align (offsets 0, uncertainty 0)")
        return 0
    for key, node in sorted(nodes.items(), key=lambda kv: int(kv[0])):
        print(f"node {key} ({node.get('host')}): clock {node.get('offset_us', 0.0):+.1f} us from node 0's "
              f"(+- {node.get('uncertainty_us', 0.0):.1f} us); its roles' times are read shifted by it")
    return 0


def _ps_command(args: argparse.Namespace) -> Optional[int]:
    """A parameter-server run (--backend mxnet) for a command whose torch view does not apply: its PS answer, or
    None for the commands that handle PS runs themselves (replay, timeline) and for other runs."""
    run_dir = getattr(args, "run_dir", None)
    name = args.func.__name__
    if not run_dir or name in ("_cmd_replay", "_cmd_timeline", "_cmd_replay_ps"):
        return None
    from dprorun.replay.ps import format_ps_prediction, predict_ps, ps_graph, PSWhatIf
    from dprorun.replay.ps_model import build_ps_model, is_ps_run

    if not is_ps_run(run_dir):
        return None
    if name == "_cmd_align":
        return _align_ps(run_dir, getattr(args, "json", False))
    model = build_ps_model(run_dir)
    if name == "_cmd_report":
        from dprorun.report import write_ps_report

        path, data = write_ps_report(run_dir, args.output, model)
        if args.json:
            print(json.dumps(data, indent=2, default=float))
            return 0
        print(format_ps_prediction(model, predict_ps(model)))
        print("what if: " + "; ".join(f"{label} " + ", ".join(f"{x:g}: {y:.2f} ms" for x, y in data["whatif"][curve])
                                      for curve, label in (("servers", "servers"), ("world_size", "workers"),
                                                           ("bandwidth_gbit", "Gbit/s"))))
        print(f"report written to {path} (self-contained HTML: open it in a browser)")
        return 0
    if name == "_cmd_optimize":
        return _optimize_ps(args, model)
    if name == "_cmd_graph":
        graph = ps_graph(model, PSWhatIf())
        stats = graph.stats()
        if getattr(args, "json", False):
            print(json.dumps(stats, indent=2))
            return 0
        print(f"parameter-server graph of one iteration: {stats['nodes']} ops, {stats['edges']} edges, "
              f"{stats['devices']} devices ({', '.join(graph.device_names)})")
        print("ops by kind: " + ", ".join(f"{k} {v}" for k, v in stats["kinds"].items()))
        return 0
    prediction = predict_ps(model)
    if getattr(args, "json", False):
        print(json.dumps({"model": model.to_json(), "as_run": prediction.to_json()}, indent=2, default=float))
        return 0
    print(format_ps_prediction(model, prediction))
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    if not isinstance(sys.stdout, StdoutThatOutlivesItsReader):  # `dpro graph RUN | head`
        sys.stdout, sys.stderr = StdoutThatOutlivesItsReader(sys.stdout), StdoutThatOutlivesItsReader(sys.stderr)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        answered = _ps_command(args)
        if answered is not None:
            return answered
        return args.func(args)
    except TraceError as exc:
        print(f"dpro: error: {exc}", file=sys.stderr)
        return 2
    except (UnanswerableError, argparse.ArgumentTypeError) as exc:  # a question the run cannot answer, bad flags
        print(f"dpro: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: nothing of the run was being written that a later command needs
        print("\ndpro: interrupted (SIGINT)", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the output went into `head` or the like, which stopped reading: end quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at interpreter exit
        return 141  # 128 + SIGPIPE, as a process the signal ended


if __name__ == "__main__":
    sys.exit(main())
