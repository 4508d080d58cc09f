"""A conv net whose loop all-reduces its loss for logging every step (and evaluates every 10 steps)."""
import argparse, statistics, time
import torch, torch.distributed as dist, torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset
p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=40)
p.add_argument("--workers", type=int, default=0)
a = p.parse_args()
dist.init_process_group("gloo"); torch.manual_seed(0); torch.set_num_threads(1)
model = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                      nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
                      nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 10))
ddp = nn.parallel.DistributedDataParallel(model)
opt = torch.optim.AdamW(ddp.parameters(), 1e-3)
sched = torch.optim.lr_scheduler.StepLR(opt, 10)
data = TensorDataset(torch.randn(32 * 8, 3, 32, 32), torch.randint(0, 10, (32 * 8,)))
loader = DataLoader(data, batch_size=32, shuffle=True, num_workers=a.workers, persistent_workers=a.workers > 0)
times, step = [], 0
while step < a.steps:
    for x, y in loader:
        t = time.perf_counter()
        opt.zero_grad()
        loss = nn.functional.cross_entropy(ddp(x), y)
        loss.backward(); opt.step(); sched.step()
        logged = loss.detach().clone(); dist.all_reduce(logged); logged /= dist.get_world_size()
        if step % 10 == 9:
            ddp.eval()
            with torch.no_grad():
                ddp(x[:8])
            ddp.train()
        times.append(time.perf_counter() - t); step += 1
        if step >= a.steps:
            break
if dist.get_rank() == 0:
    print(f"median iteration time: {statistics.median(times[len(times)//2:]) * 1000:.3f} ms, loss {logged.item():.3f}")
dist.barrier(); dist.destroy_process_group()
