"""The shape of torch's ImageNet example, small: a conv net with BatchNorm, a DistributedSampler over a dataset,
set_epoch each epoch, SGD with momentum and weight decay, a StepLR schedule stepped each epoch, a validation pass
each epoch whose correct counts are all-reduced, and rank 0 saving a checkpoint at the end. Launched as the
tutorial launches it: `torchrun --nproc-per-node 2 tutorial_ddp_cnn.py` (here: `dprorun -np 2 python ...`)."""
import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

p = argparse.ArgumentParser()
p.add_argument("--epochs", type=int, default=4)
p.add_argument("--steps-per-epoch", type=int, default=12)
p.add_argument("--batch-size", type=int, default=32)
p.add_argument("--steps", type=int, default=None,  # as benchmarks/unseen_shapes.py passes it
               help="steps in all: whole epochs of --steps-per-epoch")
a = p.parse_args()
if a.steps:
    a.epochs = max(1, a.steps // a.steps_per_epoch)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = nn.Sequential(
    nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
    nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
    nn.Flatten(), nn.Linear(64 * 8 * 8, 256), nn.ReLU(), nn.Linear(256, 10))
ddp = DDP(model)
criterion = nn.CrossEntropyLoss()
optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.1)
n = a.steps_per_epoch * a.batch_size * world
train = TensorDataset(torch.randn(n, 3, 32, 32), torch.randint(0, 10, (n,)))
val = TensorDataset(torch.randn(4 * a.batch_size * world, 3, 32, 32), torch.randint(0, 10, (4 * a.batch_size * world,)))
sampler = DistributedSampler(train)
loader = DataLoader(train, batch_size=a.batch_size, sampler=sampler)
val_loader = DataLoader(val, batch_size=a.batch_size, sampler=DistributedSampler(val, shuffle=False))
times = []
for epoch in range(a.epochs):
    sampler.set_epoch(epoch)
    ddp.train()
    for images, target in loader:
        t = time.perf_counter()
        loss = criterion(ddp(images), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        times.append(time.perf_counter() - t)
    scheduler.step()
    ddp.eval()
    correct = torch.zeros(2)
    with torch.no_grad():
        for images, target in val_loader:
            correct += torch.tensor([(ddp(images).argmax(1) == target).sum().item(), len(target)])
    dist.all_reduce(correct)
    if rank == 0:
        print(f"epoch {epoch}: loss {loss.item():.3f}, val acc {correct[0] / correct[1]:.3f}", flush=True)
if rank == 0:
    torch.save({"model": ddp.module.state_dict(), "optimizer": optimizer.state_dict()},
               os.path.join(tempfile.gettempdir(), f"tutorial_ddp_cnn_{os.getpid()}.pt"))
    os.remove(os.path.join(tempfile.gettempdir(), f"tutorial_ddp_cnn_{os.getpid()}.pt"))
    print(f"median iteration {statistics.median(times[len(times) // 2:]) * 1000:.3f} ms", flush=True)
dist.destroy_process_group()
