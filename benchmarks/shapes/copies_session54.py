"""Scripts that copy the model they train (session 54): `dprorun -np 2 python copies_session54.py --ema-of-ddp`,
`dprorun --backend horovod -np 2 python copies_session54.py --horovod --ema`.

--ema-of-ddp: torch.optim.swa_utils.AveragedModel of the DDP model itself (an EMA: AveragedModel deep-copies the
module it is given), updated after every step, its loss read every 10 steps; a conv net, SGD with momentum.
--snapshot: DDP; the best model so far kept by copy.deepcopy of the wrapped model, and the whole wrapped model
written by torch.save every 10 steps on rank 0 (a checkpoint of the module, not its state_dict); an MLP, AdamW.
--horovod --ema: the same EMA of the model a horovod.torch DistributedOptimizer trains; Adam.
--horovod --save-whole: horovod.torch, torch.save(model) of the whole module every 10 steps on rank 0 and a
deepcopy kept as the best model; an MLP, SGD.
Rank 0 prints the median step time of the second half.
"""
import argparse
import copy
import io
import statistics
import time

import torch
import torch.nn as nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

p = argparse.ArgumentParser()
for flag in ("--ema-of-ddp", "--snapshot", "--horovod", "--ema", "--save-whole"):
    p.add_argument(flag, action="store_true")
p.add_argument("--steps", type=int, default=60)
a = p.parse_args()
torch.manual_seed(0)
if a.horovod:
    import horovod.torch as hvd

    hvd.init(); torch.set_num_threads(1)
    rank = hvd.rank()
else:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()

conv = a.ema_of_ddp
if conv:
    net = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(),
                        nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(512, 10))
    x = torch.randn(32, 3, 24, 24)
else:
    net = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
    x = torch.randn(64, 256)
y = torch.randint(0, 10, (x.shape[0],))
if a.horovod:
    model = net
    inner = torch.optim.Adam(net.parameters(), lr=1e-3) if a.ema else torch.optim.SGD(net.parameters(), lr=0.01)
    opt = hvd.DistributedOptimizer(inner, named_parameters=net.named_parameters())
    hvd.broadcast_parameters(net.state_dict(), root_rank=0)
else:
    model = nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9) if conv else \
        torch.optim.AdamW(model.parameters(), lr=1e-3)
ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.99)) if (a.ema_of_ddp or a.ema) else None
best, best_loss = None, float("inf")
loss_fn = nn.CrossEntropyLoss()
times = []
for step in range(a.steps):
    start = time.perf_counter()
    opt.zero_grad()
    loss = loss_fn(model(x), y)
    loss.backward()
    opt.step()
    if ema is not None:
        ema.update_parameters(model)
        if step % 10 == 9:
            with torch.no_grad():
                ema_loss = loss_fn(ema(x), y).item()
    if a.snapshot or a.save_whole:
        if loss.item() < best_loss:
            best, best_loss = copy.deepcopy(model), loss.item()
        if step % 10 == 9 and rank == 0:
            torch.save(model, io.BytesIO())
    times.append(time.perf_counter() - start)
if rank == 0:
    print(f"median iteration time: {statistics.median(times[len(times) // 2:]) * 1000:.3f} ms")
if not a.horovod:
    dist.destroy_process_group()
