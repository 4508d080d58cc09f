"""Clock alignment on real 4-rank CPU jobs with injected clock skew (DPRO_TEST_CLOCK_SKEW_US), both comm modes.

All ranks share this machine's clock, so the skew knob shifts every timestamp a rank takes (hooks, profiler,
probes) by a known amount per rank; alignment must recover it. Each rank is declared a separate host
(DPRO_TEST_HOSTS) so the same-host term does not help.

usage: python benchmarks/align_real.py [--reps 3] [--np 4]
"""
import argparse
import json
import os
import random
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def one_run(nproc: int, mode: str, skew: list[float]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = os.path.join(tmp, "run")
        env = dict(os.environ, DPRO_TEST_CLOCK_SKEW_US=",".join(f"{s:.1f}" for s in skew),
                   DPRO_TEST_HOSTS=",".join(f"h{r}" for r in range(nproc)))
        subprocess.run([sys.executable, "-m", "dprorun.cli", "-np", str(nproc), "--run-dir", run_dir, "-q",
                        "--comm-detail", mode, "--warmup", "3", "--active", "6", "--kineto-iters", "2",
                        "--clean", "2", "python", os.path.join(REPO, "examples", "mlp_many_layers.py"),
                        "--steps", "16", "--bucket-mb", "1"], env=env, check=True, capture_output=True,
                       cwd=REPO, timeout=600)
        out = subprocess.run([sys.executable, "-m", "dprorun.offline_cli", "align", run_dir, "--json"],
                             capture_output=True, text=True, check=True, cwd=REPO)
        return json.loads(out.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--np", type=int, default=4)
    args = parser.parse_args()
    rng = random.Random(0)
    print(f"{'mode':7} {'rep':>3} {'max |error| us':>14} {'violations before':>17} {'after':>5} {'solve s':>7} method")
    worst = {}
    for rep in range(args.reps):
        skew = [0.0] + [rng.uniform(-5000, 5000) for _ in range(args.np - 1)]
        for mode in ("ring", "bucket"):
            doc = one_run(args.np, mode, skew)
            error = max(abs(doc["offsets_us"][str(r)] - (skew[0] - skew[r])) for r in range(args.np))
            worst[mode] = max(worst.get(mode, 0.0), error)
            print(f"{mode:7} {rep:3d} {error:14.1f} {doc['violations_before']:17d} {doc['violations_after']:5d} "
                  f"{doc['solve_time_s']:7.2f} {doc['method']}", flush=True)
    print(f"worst offset error over {args.reps} runs: ring {worst['ring']:.1f} us, bucket {worst['bucket']:.1f} us")


if __name__ == "__main__":
    main()
