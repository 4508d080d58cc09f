"""Analysis time and peak memory as the job grows: the job-end analysis and `dpro report` on run directories of
64 to 1,024 ranks made from one real 2-rank run.

A real 2-rank profile of a Transformer (examples/transformer_small.py, default window) is the seed (or --seed-run
DIR). Rank r of an N-rank run directory is a copy of seed rank r mod 2 with its rank fields renumbered, eight
ranks to a host ("node<r // 8>"), and every timestamp (events, clock probes, the profiler's base time) shifted
by that host's clock offset (uniform in +-3 ms, node 0 at 0) plus a per-rank jitter of up to 200 us on each
iteration start, so the alignment has real offsets to recover. Rank 0's clock probes are extended to every
rank (the seed's rounds with rank 1, as rank 1 answered them, on the peer's shifted clock).

Each analysis runs in a fresh process; wall time and peak memory (the RSS of its process tree, parallel readers
included, sampled every 20 ms) are measured.
  job-end: what finalize does after the job (RunAnalysis: read, summary, alignment, replay, report.html)
  report:  `dpro report RUN_DIR`
Also printed: the alignment's largest error against the injected offsets.

usage: python benchmarks/analysis_scale.py [--ranks 64,128,256,512,1024] [--seed-run DIR] [--keep]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from dprorun.synth import replicate_run_dir  # noqa: E402

JOB_END = """
import sys
from dprorun.analysis import RunAnalysis
from dprorun.report import write_report
analysis = RunAnalysis(sys.argv[1])
analysis.summary
analysis.alignment
analysis.prediction
write_report(analysis, whatif_time_budget_s=5.0, max_whatif_ops=300_000)
"""


def seed_run(path: str) -> str:
    cmd = [sys.executable, "-m", "dprorun.cli", "-np", "2", "--run-dir", path, "-q", "python",
           os.path.join(REPO, "examples", "transformer_small.py"), "--steps", "36"]
    subprocess.run(cmd, check=True, cwd=REPO, env=dict(os.environ, DPRO_REPORT="0"), timeout=600)
    return path


def measured(cmd: list[str]) -> tuple[float, float]:
    """Wall seconds and peak memory (MB) of one command: the RSS of its whole process tree (the parallel readers
    included), sampled every 20 ms."""
    import psutil

    started = time.perf_counter()
    errors = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=errors, text=True)
    root, peak = psutil.Process(proc.pid), 0
    while proc.poll() is None:
        try:
            tree = [root] + root.children(recursive=True)
            peak = max(peak, sum(p.memory_info().rss for p in tree if p.is_running()))
        except psutil.Error:
            pass
        time.sleep(0.02)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        errors.seek(0)
        raise SystemExit(f"{' '.join(cmd[:4])} failed:\n{errors.read()[-3000:]}")
    return wall, peak / 2 ** 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="64,128,256,512,1024")
    parser.add_argument("--seed-run", default=None, help="a 2-rank run directory to scale (default: profile one)")
    parser.add_argument("--keep", action="store_true", help="keep the generated run directories")
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="dpro-scale-")
    seed = args.seed_run or seed_run(os.path.join(work, "seed"))
    traces_mb = sum(os.path.getsize(os.path.join(seed, f"rank_{r}", f)) for r in (0, 1)
                    for f in os.listdir(os.path.join(seed, f"rank_{r}"))) / 2 / 1e6
    print(f"seed: {seed} ({traces_mb:.2f} MB of traces per rank)")
    print(f"{'ranks':>5} {'traces MB':>9} {'job-end s':>9} {'job-end MB':>10} {'report s':>8} {'report MB':>9} "
          f"{'align s':>7} {'rows':>7} {'max |err| us':>12}", flush=True)
    rng = random.Random(1)
    last = None
    for world in (int(w) for w in args.ranks.split(",")):
        target = os.path.join(work, f"run{world}")
        offsets = replicate_run_dir(seed, world, target, rng)
        size = sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(target) for f in fs) / 1e6
        job_end_s, job_end_mb = measured([sys.executable, "-c", JOB_END, target])
        report_s, report_mb = measured([sys.executable, "-m", "dprorun.offline_cli", "report", target, "--json"])
        alignment = json.load(open(os.path.join(target, "alignment.json")))
        error = max(abs(alignment["offsets_us"][str(r)] + offsets[r] - offsets[0]) for r in offsets)
        print(f"{world:5d} {size:9.0f} {job_end_s:9.1f} {job_end_mb:10.0f} {report_s:8.1f} {report_mb:9.0f} "
              f"{alignment['solve_time_s']:7.2f} {alignment['constraint_rows']:7d} {error:12.1f}", flush=True)
        last = (world, report_s, report_mb)
        if not args.keep:
            shutil.rmtree(target)
    if not args.keep and not args.seed_run:
        shutil.rmtree(work)
    world, report_s, report_mb = last
    print(f"dpro report on {world} ranks: {report_s:.1f} s, peak {report_mb:.0f} MB")


if __name__ == "__main__":
    main()
