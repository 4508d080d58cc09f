"""What one launch of a tiny 2-rank DDP job costs from start to exit: plain torchrun against dprorun (its default
window, no report), in alternating rounds. Most of the test suite is such launches (about 6 s each on the
project's 2-core VM), so this is the suite's floor per launch and dprorun's share of it.

    python benchmarks/launch_floor.py [--reps 8]

Last line: `median launch: torchrun A s, dprorun B s (+C s, +D %)`.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_SCRIPT = """
import torch, torch.distributed as dist, torch.nn as nn
dist.init_process_group("gloo")
ddp = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 4)))
opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
for step in range(24):
    opt.zero_grad()
    ddp(torch.randn(8, 64)).sum().backward()
    opt.step()
dist.destroy_process_group()
"""


def timed(cmd: list, env: dict) -> float:
    start = time.monotonic()
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    if out.returncode != 0:
        raise SystemExit(f"{cmd[2]} failed ({out.returncode}): {out.stderr[-1500:]}")
    return time.monotonic() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=8)
    args = parser.parse_args()
    env = dict(os.environ, DPRO_REPORT="0", PYTHONUNBUFFERED="1")
    times: dict[str, list[float]] = {"torchrun": [], "dprorun": []}
    print("| round | torchrun s | dprorun s |\n|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "tiny.py")
        with open(script, "w") as handle:
            handle.write(TINY_SCRIPT)
        commands = {
            "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                         "--monitor-interval", "0.1", script],
            "dprorun": [sys.executable, "-m", "dprorun.cli", "-np", "2", "-q", "python", script],
        }
        for rep in range(args.reps):
            order = ["torchrun", "dprorun"] if rep % 2 == 0 else ["dprorun", "torchrun"]
            for name in order:
                cmd = list(commands[name])
                if name == "dprorun":
                    cmd[3:3] = ["--run-dir", os.path.join(tmp, f"run{rep}")]
                times[name].append(timed(cmd, env))
            print(f"| {rep} | {times['torchrun'][-1]:.2f} | {times['dprorun'][-1]:.2f} |", flush=True)
    plain, ours = statistics.median(times["torchrun"]), statistics.median(times["dprorun"])
    print(f"spread: torchrun {min(times['torchrun']):.2f}-{max(times['torchrun']):.2f} s, dprorun "
          f"{min(times['dprorun']):.2f}-{max(times['dprorun']):.2f} s")
    print(f"median launch: torchrun {plain:.2f} s, dprorun {ours:.2f} s ({ours - plain:+.2f} s, "
          f"{100 * (ours / plain - 1):+.1f} %)")


if __name__ == "__main__":
    main()
