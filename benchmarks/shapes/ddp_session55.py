"""PyTorch shapes not tuned for (session 55): `dprorun -np 2 python ddp_session55.py --nanogpt` (or another mode).

--nanogpt: nanoGPT's loop shape: a tied-embedding GPT (4 blocks, 128 wide), gradient accumulation of --accum
micro-batches through `model.require_backward_grad_sync` (not no_sync), AdamW with decay / no-decay groups,
cosine learning rate with warm-up set by hand, clip_grad_norm_, a disabled GradScaler, an evaluation every 20 steps
on the raw module.
--late-builtin-hook: DDP's own all-reduce for --late steps, then DDP's C++ FP16_COMPRESS hook
(`_register_builtin_comm_hook`); a conv net with BatchNorm, SGD with momentum.
--tensorboard-graph: torch.utils.tensorboard: the model's graph written at step 8 (add_graph traces it), the loss
each step, histograms of the parameters every 10 steps; an MLP with dropout, seeded, Adam.
Rank 0 prints the median step time of the second half.
"""
import argparse
import math
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--nanogpt", action="store_true")
p.add_argument("--accum", type=int, default=4)
p.add_argument("--late-builtin-hook", action="store_true")
p.add_argument("--late", type=int, default=10)
p.add_argument("--tensorboard-graph", action="store_true")
p.add_argument("--steps", type=int, default=60)
a = p.parse_args()
dist.init_process_group("gloo")
rank = dist.get_rank()
V, T, C = 512, 64, 128


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(C), nn.LayerNorm(C)
        self.attn = nn.MultiheadAttention(C, 4, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(C, 4 * C), nn.GELU(), nn.Linear(4 * C, C))

    def forward(self, x):
        h = self.ln1(x)
        mask = torch.triu(torch.ones(T, T, dtype=torch.bool), 1)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, C), nn.Embedding(T, C)
        self.blocks = nn.ModuleList([Block() for _ in range(4)])
        self.lnf, self.head = nn.LayerNorm(C), nn.Linear(C, V, bias=False)
        self.wte.weight = self.head.weight

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(T))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.lnf(x))
        return logits, F.cross_entropy(logits.view(-1, V), targets.view(-1))


def nanogpt_steps():
    torch.manual_seed(1337 + rank)
    raw = GPT()
    decay = [q for q in raw.parameters() if q.dim() >= 2]
    rest = [q for q in raw.parameters() if q.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=6e-4, betas=(0.9, 0.95))
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    model = nn.parallel.DistributedDataParallel(raw)
    data = torch.randint(0, V, (20000,))

    def batch():
        ix = torch.randint(len(data) - T - 1, (8,))
        return torch.stack([data[i:i + T] for i in ix]), torch.stack([data[i + 1:i + 1 + T] for i in ix])

    x, y = batch()
    for step in range(a.steps):
        lr = 6e-4 * (step + 1) / 5 if step < 5 else 6e-5 + 0.5 * (1 + math.cos(math.pi * step / a.steps)) * 5.4e-4
        for group in opt.param_groups:
            group["lr"] = lr
        if step % 20 == 0 and step > 0:
            raw.eval()
            with torch.no_grad():
                raw(*batch())
            raw.train()
        for micro in range(a.accum):
            model.require_backward_grad_sync = micro == a.accum - 1
            _, loss = model(x, y)
            x, y = batch()
            scaler.scale(loss / a.accum).backward()
        scaler.unscale_(opt)
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        yield


def late_builtin_hook_steps():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1),
                        nn.BatchNorm2d(64), nn.ReLU(), nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(1024, 10))
    model = nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))
    for step in range(a.steps):
        if step == a.late:
            model._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        yield


def tensorboard_graph_steps():
    from torch.utils.tensorboard import SummaryWriter

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Dropout(0.2), nn.Linear(512, 512), nn.ReLU(),
                        nn.Dropout(0.2), nn.Linear(512, 10))
    model = nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    writer = SummaryWriter(os.path.join(tempfile.mkdtemp(prefix="tb-"), f"rank{rank}"))
    for step in range(a.steps):
        x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
        if step == 8:
            writer.add_graph(model.module, x)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        writer.add_scalar("loss", loss.item(), step)
        if step % 10 == 0:
            for name, param in model.named_parameters():
                writer.add_histogram(name, param, step)
        yield
    writer.close()


steps = nanogpt_steps() if a.nanogpt else late_builtin_hook_steps() if a.late_builtin_hook else tensorboard_graph_steps()
times, start = [], time.perf_counter()
for _ in steps:
    now = time.perf_counter()
    times.append(now - start)
    start = now
if rank == 0:
    print(f"median iteration time: {statistics.median(times[len(times) // 2:]) * 1000:.3f} ms")
dist.destroy_process_group()
