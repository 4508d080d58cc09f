"""`dpro`: offline analysis of a run directory (no GPU, no job needed)."""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional, Sequence

from dprorun.fsutil import TraceError


def _cmd_summary(args: argparse.Namespace) -> int:
    from dprorun.summary import format_summary, summarize_run

    summary = summarize_run(args.run_dir)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(format_summary(summary))
    return 0


def load_aligned(run_dir: str):
    """Load a run and put every rank on the reference clock (alignment.json is rewritten)."""
    from dprorun.align import align, apply_alignment
    from dprorun.fsutil import atomic_write_json
    from dprorun.trace.rundir import load_run

    run = load_run(run_dir)
    alignment = align(run)
    atomic_write_json(os.path.join(run_dir, "alignment.json"), alignment.to_json(), indent=2)
    apply_alignment(run, alignment)
    return run, alignment


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
        print(f"  rank {rank}: {offset:+.1f} us{probe}")
    print(f"causality violations: {alignment.violations_before} before, {alignment.violations_after} after "
          f"alignment (of {alignment.pairs_checked} cross-rank dependencies)")
    for warning in alignment.warnings:
        print(f"warning: {warning}")
    return 0


def _cmd_graph(args: argparse.Namespace) -> int:
    from dprorun.graph.build import build_global_dfg

    run, _ = load_aligned(args.run_dir)
    dfg = build_global_dfg(run, args.iteration)
    report = {"stats": dfg.stats(), "problems": dfg.check(), "notes": dfg.notes}
    print(json.dumps(report, indent=2))
    return 0 if not report["problems"] else 1


def _cmd_timeline(args: argparse.Namespace) -> int:
    from dprorun.timeline import write_hta_dir, write_timeline

    run, alignment = load_aligned(args.run_dir)
    out = write_timeline(run, args.output)
    print(f"wrote {out['events']} events to {out['path']} (aligned: {alignment.method}); open it in "
          "https://ui.perfetto.dev or chrome://tracing")
    if args.hta_dir:
        files = write_hta_dir(run, args.hta_dir)
        print(f"wrote {len(files)} per-rank Kineto-format files to {args.hta_dir} (Holistic Trace Analysis)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dpro", description="Analyse a dprorun run directory.")
    sub = parser.add_subparsers(dest="command", required=True)
    summary = sub.add_parser("summary", help="per-rank iteration time and compute/communication breakdown")
    summary.add_argument("run_dir")
    summary.add_argument("--json", action="store_true", help="print the summary as JSON")
    summary.set_defaults(func=_cmd_summary)
    al = sub.add_parser("align", help="solve per-rank clock offsets (cvxpy) and count causality violations")
    al.add_argument("run_dir")
    al.add_argument("--json", action="store_true")
    al.set_defaults(func=_cmd_align)
    graph = sub.add_parser("graph", help="build the global dataflow graph of one iteration and check it")
    graph.add_argument("run_dir")
    graph.add_argument("--iteration", type=int, default=None)
    graph.set_defaults(func=_cmd_graph)
    tl = sub.add_parser("timeline", help="export the aligned global timeline as Chrome-trace JSON")
    tl.add_argument("run_dir")
    tl.add_argument("-o", "--output", required=True)
    tl.add_argument("--hta-dir", default=None, help="also write per-rank Kineto-format files for HTA")
    tl.set_defaults(func=_cmd_timeline)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except TraceError as exc:
        print(f"dpro: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
