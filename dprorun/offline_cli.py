"""`dpro`: offline analysis of a run directory (no GPU, no job needed)."""
from __future__ import annotations

import argparse
import json
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dpro", description="Analyse a dprorun run directory.")
    sub = parser.add_subparsers(dest="command", required=True)
    summary = sub.add_parser("summary", help="per-rank iteration time and compute/communication breakdown")
    summary.add_argument("run_dir")
    summary.add_argument("--json", action="store_true", help="print the summary as JSON")
    summary.set_defaults(func=_cmd_summary)
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
