"""DDP shapes of a user's own training loop: --eval (epochs over a DistributedSampler with set_epoch, a validation
pass through the DDP model under no_grad after each), --sparse (an EmbeddingBag with sparse gradients beside a dense
head), --frozen (the conv trunk frozen), --sched (AdamW, OneCycleLR, gradient clipping)."""
import argparse, statistics, time
import torch, torch.distributed as dist, torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler
p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=40); p.add_argument("--eval", action="store_true")
p.add_argument("--sparse", action="store_true"); p.add_argument("--frozen", action="store_true")
p.add_argument("--sched", action="store_true")
a = p.parse_args()
dist.init_process_group("gloo"); torch.manual_seed(0); torch.set_num_threads(1)


class Net(nn.Module):
    def __init__(s):
        super().__init__()
        s.trunk = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
                                nn.AdaptiveAvgPool2d(4), nn.Flatten())
        s.emb = nn.EmbeddingBag(20000, 64, mode="sum", sparse=True) if a.sparse else None
        s.head = nn.Sequential(nn.Linear(512 + (64 if a.sparse else 0), 1024), nn.ReLU(), nn.Linear(1024, 10))

    def forward(s, x, ids=None):
        h = s.trunk(x)
        if s.emb is not None:
            h = torch.cat([h, s.emb(ids)], dim=1)
        return s.head(h)


model = Net()
if a.frozen:
    for param in model.trunk.parameters():
        param.requires_grad_(False)
ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1)
params = [q for q in ddp.parameters() if q.requires_grad]
if a.sched:
    opt = torch.optim.AdamW(params, lr=1e-3)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=a.steps)
else:
    opt, sched = torch.optim.SGD(params, lr=0.01), None
per_epoch = 10 if a.eval else a.steps
data = TensorDataset(torch.randn(16 * per_epoch * dist.get_world_size(), 3, 32, 32),
                     torch.randint(0, 20000, (16 * per_epoch * dist.get_world_size(), 8)),
                     torch.randint(0, 10, (16 * per_epoch * dist.get_world_size(),)))
sampler = DistributedSampler(data, shuffle=True)
loader = DataLoader(data, batch_size=16, sampler=sampler)
times, step, epoch = [], 0, 0
while step < a.steps:
    sampler.set_epoch(epoch)
    ddp.train()
    for x, ids, y in loader:
        if step == a.steps:
            break
        t = time.perf_counter()
        opt.zero_grad()
        loss = nn.functional.cross_entropy(ddp(x, ids), y)
        loss.backward()
        if a.sched:
            nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if sched is not None:
            sched.step()
        times.append(time.perf_counter() - t)
        step += 1
    if a.eval:
        ddp.eval()
        correct = torch.zeros(())
        with torch.no_grad():
            for x, ids, y in DataLoader(data, batch_size=64, sampler=sampler):
                correct += (ddp(x, ids).argmax(1) == y).sum()
        dist.all_reduce(correct)
    epoch += 1
if dist.get_rank() == 0:
    tail = times[len(times) // 2:]
    print(f"median iteration time: {statistics.median(tail) * 1000:.3f} ms")
dist.destroy_process_group()
