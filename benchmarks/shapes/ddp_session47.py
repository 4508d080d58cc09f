"""Shapes of current PyTorch (2.13) not tuned for (session 47): `dprorun -np 2 python ddp_session47.py --mesh`.

--mesh: DDP given a device mesh (init_device_mesh), a conv net with BatchNorm, SGD with Nesterov momentum, OneCycleLR,
gradient clipping.
--muon: torch's Muon on the hidden 2-D weights and AdamW on the rest, two optimizers a step, a cosine schedule.
--no-backend: init_process_group() with no backend (torch picks one per device at the first collective), an MLP with
LayerNorm and GELU.
"""
import argparse, os, statistics, time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

p = argparse.ArgumentParser()
for flag in ("--mesh", "--muon", "--no-backend"):
    p.add_argument(flag, action="store_true")
p.add_argument("--steps", type=int, default=60)
a = p.parse_args()
dist.init_process_group(None if a.no_backend else "gloo")
torch.manual_seed(0)
if a.mesh:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (int(os.environ["WORLD_SIZE"]),))
    net = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
                        nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.AdaptiveAvgPool2d(4),
                        nn.Flatten(), nn.Linear(64 * 16, 256), nn.ReLU(), nn.Linear(256, 10))
    model = DDP(net, device_mesh=mesh)
    x, y = torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,))
    optimizers = [torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True)]
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizers[0], max_lr=0.1, total_steps=a.steps)
else:
    net = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.LayerNorm(512), nn.Linear(512, 512), nn.GELU(),
                        nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 10))
    model = DDP(net)
    x, y = torch.randn(128, 256), torch.randint(0, 10, (128,))
    if a.muon:
        hidden = [q for name, q in model.named_parameters() if q.ndim == 2 and not name.startswith("module.7.")]
        rest = [q for name, q in model.named_parameters() if not (q.ndim == 2 and not name.startswith("module.7."))]
        optimizers = [torch.optim.Muon(hidden, lr=0.02), torch.optim.AdamW(rest, lr=1e-3)]
    else:
        optimizers = [torch.optim.AdamW(model.parameters(), lr=1e-3)]
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizers[0], a.steps)
times = []
for step in range(a.steps):
    t = time.perf_counter()
    for opt in optimizers:
        opt.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(model(x), y).backward()
    if a.mesh:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    for opt in optimizers:
        opt.step()
    schedule.step()
    times.append(time.perf_counter() - t)
if dist.get_rank() == 0:
    print(f"steps: {a.steps}; median iteration time: {statistics.median(times[len(times) // 2:]) * 1000:.3f} ms")
del model, net, optimizers
dist.barrier()
dist.destroy_process_group()
