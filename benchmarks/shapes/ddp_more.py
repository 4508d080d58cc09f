"""--gan: two DDP models, two optimizers, D stepped then G; --ckpt: activation checkpointing;
--zero: ZeroRedundancyOptimizer."""
import argparse, statistics, time
import torch, torch.distributed as dist, torch.nn as nn
from torch.utils.checkpoint import checkpoint
p = argparse.ArgumentParser(); p.add_argument("--steps", type=int, default=40)
p.add_argument("--gan", action="store_true"); p.add_argument("--ckpt", action="store_true")
p.add_argument("--zero", action="store_true")
a = p.parse_args()
dist.init_process_group("gloo"); torch.manual_seed(0); torch.set_num_threads(1)
DDP = nn.parallel.DistributedDataParallel
def mlp(i, o): return nn.Sequential(nn.Linear(i, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, o))
times = []
if a.gan:
    G, D = DDP(mlp(64, 256)), DDP(mlp(256, 1))
    og, od = torch.optim.Adam(G.parameters(), 1e-4), torch.optim.Adam(D.parameters(), 1e-4)
    real = torch.randn(64, 256)
    for step in range(a.steps):
        t = time.perf_counter()
        z = torch.randn(64, 64)
        fake = G(z)
        od.zero_grad()
        ld = nn.functional.softplus(-D(real)).mean() + nn.functional.softplus(D(fake.detach())).mean()
        ld.backward(); od.step()
        og.zero_grad()
        lg = nn.functional.softplus(-D(fake)).mean()
        lg.backward(); og.step()
        times.append(time.perf_counter() - t)
else:
    class Net(nn.Module):
        def __init__(s):
            super().__init__(); s.blocks = nn.ModuleList([mlp(512, 512) for _ in range(4)]); s.out = nn.Linear(512, 10)
        def forward(s, x):
            for b in s.blocks:
                x = checkpoint(b, x, use_reentrant=False) if a.ckpt else b(x)
            return s.out(x)
    model = DDP(Net(), bucket_cap_mb=2)
    if a.zero:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-4)
    else:
        opt = torch.optim.Adam(model.parameters(), 1e-4)
    x = torch.randn(64, 512); y = torch.randint(0, 10, (64,))
    for step in range(a.steps):
        t = time.perf_counter()
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - t)
if dist.get_rank() == 0:
    print(f"median iteration time: {statistics.median(times[len(times)//2:]) * 1000:.3f} ms")
dist.barrier(); dist.destroy_process_group()
