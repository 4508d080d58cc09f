"""The DDP tutorial's ToyModel (Linear 512->1024, ReLU, Linear 1024->512), MSELoss, SGD, batch 64, as a torchrun
script: `dprorun -np 2 python ddp_toy_torchrun.py`, the launched counterpart of `ddp_spawned.py --tutorial`
(session 53's comparison of spawned and launched ranks under the hooks)."""
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
torch.set_num_threads(1)
torch.manual_seed(dist.get_rank())
model = DDP(nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 512)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.001)
loss_fn = nn.MSELoss()
for step in range(60):
    optimizer.zero_grad()
    loss_fn(model(torch.randn(64, 512)), torch.randn(64, 512)).backward()
    optimizer.step()
dist.barrier()
dist.destroy_process_group()
