"""DDP shapes: --scaler: GradScaler with bf16 autocast; --varlen: an LSTM on sequences whose length changes every
step (8-39 tokens); --join: uneven inputs (rank r runs 3r more steps) under DDP's join context; else an MLP.
(SyncBatchNorm is left out: torch runs it on GPU modules only.)"""
import argparse, statistics, time
import torch, torch.distributed as dist, torch.nn as nn
p = argparse.ArgumentParser(); p.add_argument("--steps", type=int, default=40)
for f in ("scaler", "varlen", "join"): p.add_argument("--" + f, action="store_true")
a = p.parse_args()
dist.init_process_group("gloo"); torch.manual_seed(0); torch.set_num_threads(1)
DDP = nn.parallel.DistributedDataParallel
rank = dist.get_rank()
if a.varlen:
    class Net(nn.Module):
        def __init__(s):
            super().__init__(); s.emb = nn.Embedding(1000, 128); s.rnn = nn.LSTM(128, 256, batch_first=True)
            s.out = nn.Linear(256, 2)
        def forward(s, x):
            return s.out(s.rnn(s.emb(x))[0][:, -1])
    model = DDP(Net())
    g = torch.Generator().manual_seed(rank)
    batch = lambda s: (torch.randint(0, 1000, (16, int(torch.randint(8, 40, (1,), generator=g)))),
                       torch.randint(0, 2, (16,)))
    loss_fn = nn.functional.cross_entropy
else:
    model = DDP(nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)))
    batch = lambda s: (torch.randn(64, 512), torch.randint(0, 10, (64,)))
    loss_fn = nn.functional.cross_entropy
opt = torch.optim.SGD(model.parameters(), 0.01, momentum=0.9)
scaler = torch.amp.GradScaler("cpu") if a.scaler else None
steps = a.steps + (3 * rank if a.join else 0)
times = []
from contextlib import nullcontext
with (model.join() if a.join else nullcontext()):
    for step in range(steps):
        t = time.perf_counter()
        x, y = batch(step)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.scaler):
            loss = loss_fn(model(x), y)
        if scaler:
            scaler.scale(loss).backward(); scaler.step(opt); scaler.update()
        else:
            loss.backward(); opt.step()
        times.append(time.perf_counter() - t)
if rank == 0:
    print(f"median iteration time: {statistics.median(times[len(times)//2:]) * 1000:.3f} ms")
dist.barrier(); dist.destroy_process_group()
