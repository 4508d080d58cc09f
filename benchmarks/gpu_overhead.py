"""GPU overhead of running under dprorun: the example's own median iteration time (second half of the run, which
holds the profiling window and the iterations after it) under plain torchrun and under dprorun variants,
interleaved, --reps times each.

Variants: torchrun; dprorun (default: CUPTI torn down after the profiler window, TEARDOWN_CUPTI=1);
dprorun with TEARDOWN_CUPTI=0 (Kineto's default: CUPTI stays subscribed after the window); dprorun --no-kineto.
usage: python benchmarks/gpu_overhead.py [--examples resnet_small] [--reps 3] [--steps 160]
Last line: the default variant's median overhead vs torchrun.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = {
    "torchrun": ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1"], {}),
    "dprorun": ([sys.executable, "-m", "dprorun.cli", "-np", "1", "-q"], {}),
    "dprorun TEARDOWN_CUPTI=0": ([sys.executable, "-m", "dprorun.cli", "-np", "1", "-q"], {"TEARDOWN_CUPTI": "0"}),
    "dprorun --no-kineto": ([sys.executable, "-m", "dprorun.cli", "-np", "1", "-q", "--no-kineto"], {}),
}


def median_ms(example: str, variant: str, steps: int) -> float | None:
    prefix, extra_env = VARIANTS[variant]
    with tempfile.TemporaryDirectory() as tmp:
        cmd = list(prefix)
        if "dprorun" in variant:
            cmd += ["--run-dir", os.path.join(tmp, "run"), "python"]
        cmd += [os.path.join(REPO, "examples", f"{example}.py"), "--steps", str(steps)]
        env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), **extra_env)
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    found = re.search(r"median iteration time: ([0-9.]+) ms", proc.stdout)
    if not found:
        print(f"{variant}: no reading (rc {proc.returncode}) {proc.stderr[-1500:]}", flush=True)
    return float(found.group(1)) if found else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", default="resnet_small")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=160)
    args = parser.parse_args()
    overheads = []
    print(f"{'example':18} {'variant':26} {'median ms':>9} {'vs torchrun':>11}  readings")
    for example in args.examples.split(","):
        readings: dict[str, list[float]] = {v: [] for v in VARIANTS}
        for _ in range(args.reps):
            for variant in VARIANTS:
                value = median_ms(example, variant, args.steps)
                if value is not None:
                    readings[variant].append(value)
        base = statistics.median(readings["torchrun"]) if readings["torchrun"] else None
        for variant, values in readings.items():
            if not values:
                continue
            med = statistics.median(values)
            rel = (med / base - 1) * 100 if base else float("nan")
            if variant == "dprorun":
                overheads.append(rel)
            print(f"{example:18} {variant:26} {med:9.3f} {rel:+10.1f}%  {' '.join(f'{v:.2f}' for v in values)}",
                  flush=True)
    print(f"dprorun overhead on GPU vs torchrun (median over examples): {statistics.median(overheads):+.1f} %"
          if overheads else "no readings")


if __name__ == "__main__":
    main()
