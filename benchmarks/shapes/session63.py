"""Shapes not tuned for (session 63), 2 ranks: `dprorun -np 2 python session63.py --unfreeze` (or another mode).

--unfreeze: gradients averaged by hand (one all_reduce per gradient that exists), a conv backbone frozen for the
first 8 steps and then fine-tuned too (gradual unfreezing), SGD with momentum.
--llrd: a transformer encoder under DDP with layer-wise learning-rate decay (a parameter group per layer, 0.8x per
layer down), AdamW, clip_grad_norm_, a linear warm-up then cosine schedule stepped every step.
--task-weights: a shared trunk and three heads under DDP, the tasks' losses weighted by learned uncertainties (three
log-variances outside the DDP model, in the same Adam, their gradients not shared).
--uneven-batches: each rank its own batch size (rank r: 32 * (r + 1) samples): DDP averages gradients of unequal
work per rank; a conv net, SGD.
--small-buckets: DDP with bucket_cap_mb=1 over an MLP of 12 MB of gradients (about 12 buckets), Adam.
--closure-adam: DDP, Adam stepped with a closure (the forward and the backward run inside optimizer.step).
--layerdrop: gradients averaged by hand over a residual MLP of 6 blocks with LayerDrop (each step skips a random 30 %
of the blocks, the same on every rank): an all_reduce per gradient that exists, so each step makes other calls.
Rank 0 prints the median step time of the second half.
"""
import argparse
import math
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

MODES = ("unfreeze", "llrd", "task_weights", "uneven_batches", "small_buckets", "closure_adam", "layerdrop")
p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=40)
for mode in MODES:
    p.add_argument("--" + mode.replace("_", "-"), action="store_true")
a = p.parse_args()


def conv_net() -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4), nn.Flatten(),
                         nn.Linear(512, 128), nn.ReLU(), nn.Linear(128, 10))


def timed(step, steps: int) -> list:
    times = []
    for k in range(steps):
        t0 = time.perf_counter()
        step(k)
        times.append(time.perf_counter() - t0)
    return times


def plain_steps(model: nn.Module, opt, x: torch.Tensor, y: torch.Tensor) -> list:
    """zero_grad, forward, cross-entropy backward, step: a.steps times, timed."""
    def step(k: int) -> None:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    return timed(step, a.steps)


def average_existing_gradients(model: nn.Module) -> None:
    """The gradients averaged by hand, one all_reduce per parameter whose gradient exists (None: frozen, skipped)."""
    world = dist.get_world_size()
    for param in model.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad)
            param.grad /= world


def unfreeze(rank: int) -> list:
    model = conv_net()
    backbone = model[:6]
    backbone.requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.rand(32, 3, 32, 32), torch.randint(0, 10, (32,))

    def step(k: int) -> None:
        if k == 8:
            backbone.requires_grad_(True)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        average_existing_gradients(model)
        opt.step()

    return timed(step, a.steps)


class Encoder(nn.Module):
    def __init__(self, layers: int):
        super().__init__()
        self.embed = nn.Linear(32, 128)
        self.blocks = nn.ModuleList(nn.TransformerEncoderLayer(128, 4, 256, batch_first=True, dropout=0.0)
                                    for _ in range(layers))
        self.head = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h.mean(1))


def llrd(rank: int) -> list:
    layers = 4
    model = DDP(Encoder(layers))
    net = model.module
    groups = [{"params": net.head.parameters(), "lr": 1e-3}]
    groups += [{"params": block.parameters(), "lr": 1e-3 * 0.8 ** (layers - k)} for k, block in enumerate(net.blocks)]
    groups.append({"params": net.embed.parameters(), "lr": 1e-3 * 0.8 ** (layers + 1)})
    opt = torch.optim.AdamW(groups, weight_decay=0.05)
    warm = 5
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / a.steps)))
    x, y = torch.randn(16, 24, 32), torch.randint(0, 10, (16,))

    def step(k: int) -> None:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()

    return timed(step, a.steps)


def task_weights(rank: int) -> list:
    class MultiTask(nn.Module):
        def __init__(self):
            super().__init__()
            self.trunk = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU())
            self.heads = nn.ModuleList([nn.Linear(256, 10), nn.Linear(256, 1), nn.Linear(256, 5)])

        def forward(self, x):
            h = self.trunk(x)
            return [head(h) for head in self.heads]

    model = DDP(MultiTask())
    log_vars = nn.Parameter(torch.zeros(3))  # outside the DDP model: each rank learns its own
    opt = torch.optim.Adam(list(model.parameters()) + [log_vars], lr=1e-3)
    x = torch.randn(64, 64)
    y_cls, y_reg, y_aux = torch.randint(0, 10, (64,)), torch.randn(64, 1), torch.randint(0, 5, (64,))

    def step(k: int) -> None:
        opt.zero_grad()
        cls, reg, aux = model(x)
        losses = torch.stack([F.cross_entropy(cls, y_cls), F.mse_loss(reg, y_reg), F.cross_entropy(aux, y_aux)])
        (torch.exp(-log_vars) * losses + log_vars).sum().backward()
        opt.step()

    return timed(step, a.steps)


def uneven_batches(rank: int) -> list:
    model = DDP(conv_net())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batch = 32 * (rank + 1)
    x, y = torch.rand(batch, 3, 32, 32), torch.randint(0, 10, (batch,))

    return plain_steps(model, opt, x, y)


def small_buckets(rank: int) -> list:
    model = DDP(nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                              nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)), bucket_cap_mb=1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.randn(32, 512), torch.randint(0, 10, (32,))

    return plain_steps(model, opt, x, y)


def closure_adam(rank: int) -> list:
    model = DDP(conv_net())
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.rand(32, 3, 32, 32), torch.randint(0, 10, (32,))

    def closure():
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss

    return timed(lambda k: opt.step(closure), a.steps)


def layerdrop(rank: int) -> list:
    blocks = nn.ModuleList(nn.Sequential(nn.Linear(256, 256), nn.ReLU()) for _ in range(6))
    head = nn.Linear(256, 10)
    model = nn.ModuleDict({"blocks": blocks, "head": head})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
    drops = torch.Generator().manual_seed(7)  # the same draws on every rank

    def step(k: int) -> None:
        opt.zero_grad(set_to_none=True)
        h = x
        for block in blocks:
            if float(torch.rand(1, generator=drops)) >= 0.3:
                h = h + block(h)
        F.cross_entropy(head(h), y).backward()
        average_existing_gradients(model)
        opt.step()

    return timed(step, a.steps)


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mode = next(m for m in MODES if getattr(a, m))
    times = globals()[mode](rank)
    if rank == 0:
        print(f"median iteration time: {statistics.median(times[len(times) // 2:]) * 1000:.3f} ms")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
