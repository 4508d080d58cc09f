"""What FSDP2 (fully_shard) does on the CPU, per collective: the ground a model of it stands on (FSDP is named, not
profiled: docs/architecture.md). Runs a 2-rank fully_shard MLP under torchrun with torch.distributed's gather and
reduce-scatter watched in each rank, and prints, for the last of 3 steps, each call's phase (forward, backward,
step), whether it was asynchronous, when it started, how long it held the calling thread and its bytes; the last line:
how many of the step's calls held the thread (synchronous: serial with the compute).

    python benchmarks/fsdp_cpu_probe.py [--units 4] [--width 512]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

RANK_SCRIPT = r'''
import json, os, sys, time, torch, torch.nn as nn, torch.distributed as dist
dist.init_process_group("gloo")
units, width = int(sys.argv[1]), int(sys.argv[2])
log, phase, origin = [], ["-"], [time.perf_counter()]

def watched(name):
    call = getattr(dist, name)

    def run(*args, **kwargs):
        start = time.perf_counter()
        work = call(*args, **kwargs)
        held = time.perf_counter() - start
        tensor = args[1] if len(args) > 1 else kwargs.get("input_tensor", kwargs.get("input"))
        log.append({"phase": phase[0], "call": name, "async": bool(kwargs.get("async_op")) or work is not None,
                    "start_ms": round((start - origin[0]) * 1e3, 3), "held_ms": round(held * 1e3, 3),
                    "input_bytes": tensor.numel() * tensor.element_size()})
        return work
    setattr(dist, name, run)

for name in ("all_gather_single", "reduce_scatter_single", "all_gather_into_tensor", "reduce_scatter_tensor"):
    if hasattr(dist, name):
        watched(name)
from torch.distributed.fsdp import fully_shard
torch.manual_seed(0)
model = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(units)], nn.Linear(width, 10))
for layer in model[:units]:
    fully_shard(layer)
fully_shard(model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
x, y = torch.randn(64, width), torch.randint(0, 10, (64,))
for step in range(3):
    log.clear()
    origin[0] = time.perf_counter()
    phase[0] = "forward"
    loss = nn.functional.cross_entropy(model(x), y)
    phase[0] = "backward"
    loss.backward()
    phase[0] = "step"
    opt.step()
    opt.zero_grad()
if dist.get_rank() == 0:
    with open(os.environ["PROBE_OUT"], "w") as handle:
        json.dump({"step_ms": round((time.perf_counter() - origin[0]) * 1e3, 3), "calls": log}, handle)
del model, opt
dist.barrier()
dist.destroy_process_group()
'''


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--units", type=int, default=4, help="fully_shard units (Linear + ReLU each)")
    parser.add_argument("--width", type=int, default=512)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        script, out = os.path.join(tmp, "rank.py"), os.path.join(tmp, "probe.json")
        with open(script, "w") as handle:
            handle.write(RANK_SCRIPT)
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                               script, str(args.units), str(args.width)], capture_output=True, text=True,
                              timeout=300, env=dict(os.environ, PROBE_OUT=out, OMP_NUM_THREADS="1"))
        if proc.returncode != 0 or not os.path.exists(out):
            sys.exit(f"the probe's job failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
        with open(out) as handle:
            doc = json.load(handle)
    print("| phase | call | asynchronous | start ms | held ms | input bytes |\n|---|---|---|---|---|---|")
    for row in doc["calls"]:
        print(f"| {row['phase']} | {row['call']} | {'yes' if row['async'] else 'no'} | {row['start_ms']:.2f} | "
              f"{row['held_ms']:.3f} | {row['input_bytes']} |")
    held = [row for row in doc["calls"] if not row["async"]]
    print(f"step {doc['step_ms']:.2f} ms; calls holding the thread {sum(r['held_ms'] for r in held):.2f} ms")
    print(f"FSDP2 on the CPU: {len(held)} of {len(doc['calls'])} collectives a step synchronous (serial with the "
          "compute)")


if __name__ == "__main__":
    main()
