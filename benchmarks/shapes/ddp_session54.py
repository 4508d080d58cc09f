"""PyTorch shapes not tuned for (session 54): `dprorun -np 2 python ddp_session54.py --late-comm-hook`.

--late-comm-hook: DDP trained with its own all-reduce for --late steps, then the script registers torch's
fp16_compress_hook (compression after a warm-up without it); a LayerNorm MLP, AdamW.
Rank 0 prints the median step time of the second half.
"""
import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

p = argparse.ArgumentParser()
p.add_argument("--late-comm-hook", action="store_true")
p.add_argument("--late", type=int, default=10)
p.add_argument("--steps", type=int, default=60)
a = p.parse_args()
dist.init_process_group("gloo")
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(256, 768), nn.LayerNorm(768), nn.ReLU(), nn.Linear(768, 768), nn.LayerNorm(768),
                    nn.ReLU(), nn.Linear(768, 10))
model = nn.parallel.DistributedDataParallel(net)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
times = []
for step in range(a.steps):
    if a.late_comm_hook and step == a.late:
        model.register_comm_hook(None, fp16_compress_hook)
    start = time.perf_counter()
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    times.append(time.perf_counter() - start)
if dist.get_rank() == 0:
    print(f"median iteration time: {statistics.median(times[len(times) // 2:]) * 1000:.3f} ms")
dist.destroy_process_group()
