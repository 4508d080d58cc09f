"""A job that trains models one after another (benchmarks/shapes/ddp_model_switch.py), under plain torchrun and
under dprorun, interleaved: rank 0's RSS after each model, and what dprorun made of the job (its self-check, or
why there is none). The hooks once held every DDP module and the window's optimizers for the rest of the job (RSS
grew by a model, its gradients, momentum and buckets per model: a cross-validation on a GPU runs out of memory
where torchrun does not) and counted iterations on the first model only.

usage: python benchmarks/model_switch.py [--reps 2] [--models 4] [--width 1024] [--steps 12] [--first-steps 0]
Last line: RSS growth from the first model to the last, medians.
"""
import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "benchmarks", "shapes", "ddp_model_switch.py")


def run(launcher: str, args: argparse.Namespace) -> tuple[list[float], str]:
    script_args = ["--models", str(args.models), "--width", str(args.width), "--steps", str(args.steps),
                   "--first-steps", str(args.first_steps)]
    with tempfile.TemporaryDirectory() as tmp:
        if launcher == "torchrun":
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", SCRIPT, *script_args]
        else:
            cmd = [sys.executable, "-m", "dprorun.cli", "--run-dir", os.path.join(tmp, "run"), "-np", "2", "python",
                   SCRIPT, *script_args]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    output = proc.stdout + proc.stderr
    rss = [float(x) for x in re.findall(r"model \d+ rss_mib ([\d.]+)", output)]
    outcome = f"exit {proc.returncode}"
    if launcher == "dprorun":
        found = re.search(r"(self-check: [^\n]*?(agrees|differs)[^\n]*?)\n|(only \d+ clean iteration)|"
                          r"(no replay[^\n]*)", output)
        outcome += "; " + (found.group(0).strip()[:90] if found else "no self-check line")
    return rss, outcome


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--models", type=int, default=4)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--first-steps", type=int, default=0)
    args = parser.parse_args()
    growth: dict[str, list[float]] = {"torchrun": [], "dprorun": []}
    print("| round | launcher | RSS after each model (MiB) | growth | outcome |")
    print("|---|---|---|---|---|")
    for rep in range(args.reps):
        for launcher in ("torchrun", "dprorun"):
            rss, outcome = run(launcher, args)
            grew = rss[-1] - rss[0] if len(rss) >= 2 else float("nan")
            growth[launcher].append(grew)
            print(f"| {rep + 1} | {launcher} | {' / '.join(f'{x:.0f}' for x in rss)} | {grew:+.1f} | {outcome} |",
                  flush=True)
    print("RSS growth from the first model to the last (median): "
          + ", ".join(f"{k} {statistics.median(v):+.1f} MiB" for k, v in growth.items()))


if __name__ == "__main__":
    main()
