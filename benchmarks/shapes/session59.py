"""Shapes not tuned for (session 59), 2 ranks: `dprorun -np 2 python session59.py --halo` (or another mode).

--halo: spatial parallelism by hand: each rank holds a slab of a long 1-D signal; every convolution first swaps a
halo with both neighbours through batch_isend_irecv (a ring of P2POps, each request waited for), gradients averaged
by DDP, Adam.
--ensemble: an ensemble of 8 MLPs trained as one with torch.func (stack_module_state, vmap over functional_call),
the stacked weights the DDP module's parameters; SGD with momentum, a label-smoothed loss.
--stream: a streamed corpus: an IterableDataset sharding its stream by rank and loader worker (get_worker_info),
2 loader workers, an EmbeddingBag text classifier, AdamW with a step-wise cosine LambdaLR; the loop counts the steps.
--diffusion: a denoising diffusion model's step: a small conv net conditioned on a sinusoidal time embedding,
random timesteps and noise per sample, an EMA of the weights (torch._foreach_lerp_), AdamW with clipping, and the
loss summed to rank 0 with dist.reduce every step.
Rank 0 prints the median step time of the second half.
"""
import argparse
import copy
import math
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=40)
p.add_argument("--halo", action="store_true")
p.add_argument("--ensemble", action="store_true")
p.add_argument("--stream", action="store_true")
p.add_argument("--diffusion", action="store_true")
a = p.parse_args()


class HaloConv(nn.Module):
    def __init__(self, channels: int, halo: int):
        super().__init__()
        self.conv = nn.Conv1d(channels, channels, 2 * halo + 1)
        self.halo = halo

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rank, world = dist.get_rank(), dist.get_world_size()
        left, right = (rank - 1) % world, (rank + 1) % world
        from_left, from_right = torch.empty_like(x[..., :self.halo]), torch.empty_like(x[..., :self.halo])
        ops = [dist.P2POp(dist.isend, x[..., -self.halo:].contiguous(), right),
               dist.P2POp(dist.isend, x[..., :self.halo].contiguous(), left),
               dist.P2POp(dist.irecv, from_left, left), dist.P2POp(dist.irecv, from_right, right)]
        for request in dist.batch_isend_irecv(ops):
            request.wait()
        return torch.relu(self.conv(torch.cat([from_left, x, from_right], dim=-1)))


def halo(rank: int) -> list:
    ddp = DDP(nn.Sequential(HaloConv(16, 32), HaloConv(16, 32), nn.Conv1d(16, 1, 1)))
    opt = torch.optim.Adam(ddp.parameters(), lr=1e-3)
    times = []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        loss = ddp(torch.randn(8, 16, 1024)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    return times


class Ensemble(nn.Module):
    def __init__(self, members: list):
        super().__init__()
        params, _ = torch.func.stack_module_state(members)
        self.names = list(params)
        self.stacked = nn.ParameterList([nn.Parameter(params[n]) for n in self.names])
        self.base = [copy.deepcopy(members[0]).to("meta")]  # a list: no submodule of DDP's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def one(weights, batch):
            return torch.func.functional_call(self.base[0], dict(zip(self.names, weights)), (batch,))
        return torch.vmap(one, in_dims=(0, None))(tuple(self.stacked), x)


def ensemble(rank: int) -> list:
    ddp = DDP(Ensemble([nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 10)) for _ in range(8)]))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss(label_smoothing=0.1)
    times = []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        x, y = torch.randn(256, 128), torch.randint(0, 10, (256,))
        loss = loss_fn(ddp(x).reshape(-1, 10), y.repeat(8))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    return times


class Stream(IterableDataset):
    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        shard, shards = self.rank * workers + worker, self.world * workers
        gen = torch.Generator().manual_seed(shard)
        for i in range(10 ** 9):
            if i % shards == shard:
                n = int(torch.randint(20, 200, (1,), generator=gen))
                yield torch.randint(0, 50000, (n,), generator=gen), int(torch.randint(0, 4, (1,), generator=gen))


def collate(batch: list) -> tuple:
    tokens = [t for t, _ in batch]
    offsets = torch.tensor([0] + [len(t) for t in tokens[:-1]]).cumsum(0)
    return torch.cat(tokens), offsets, torch.tensor([y for _, y in batch])


class BagClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.bag = nn.EmbeddingBag(50000, 64, mode="mean")
        self.head = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 4))

    def forward(self, tokens: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.head(self.bag(tokens, offsets))


def stream(rank: int) -> list:
    ddp = DDP(BagClassifier())
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / a.steps)))
    loader = DataLoader(Stream(rank, dist.get_world_size()), batch_size=64, num_workers=2, collate_fn=collate)
    times, t0 = [], time.perf_counter()
    for step, (tokens, offsets, y) in enumerate(loader):
        if step == a.steps:
            break
        loss = F.cross_entropy(ddp(tokens, offsets), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
    return times


class Denoiser(nn.Module):
    def __init__(self, width: int = 32):
        super().__init__()
        self.time = nn.Sequential(nn.Linear(32, width), nn.SiLU(), nn.Linear(width, width))
        self.inp = nn.Conv2d(3, width, 3, padding=1)
        self.mid = nn.Sequential(nn.GroupNorm(8, width), nn.SiLU(), nn.Conv2d(width, width, 3, padding=1),
                                 nn.GroupNorm(8, width), nn.SiLU(), nn.Conv2d(width, width, 3, padding=1))
        self.out = nn.Conv2d(width, 3, 3, padding=1)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        freqs = torch.exp(-math.log(1000.0) * torch.arange(16) / 16)
        emb = torch.cat([torch.sin(t[:, None] * freqs), torch.cos(t[:, None] * freqs)], dim=1)
        h = self.inp(x) + self.time(emb)[:, :, None, None]
        return self.out(h + self.mid(h))


def diffusion(rank: int) -> list:
    model = Denoiser()
    ema = [p.detach().clone() for p in model.parameters()]
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=2e-4)
    alphas = torch.cumprod(1 - torch.linspace(1e-4, 0.02, 1000), 0)
    times = []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        x0 = torch.randn(16, 3, 24, 24)
        t = torch.randint(0, 1000, (16,))
        noise = torch.randn_like(x0)
        abar = alphas[t][:, None, None, None]
        loss = F.mse_loss(ddp(abar.sqrt() * x0 + (1 - abar).sqrt() * noise, t.float()), noise)
        opt.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            torch._foreach_lerp_(ema, [p.detach() for p in model.parameters()], 1 - 0.999)
        total = loss.detach().clone()
        dist.reduce(total, dst=0)  # rank 0 logs the summed loss
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(rank)
    mode = halo if a.halo else ensemble if a.ensemble else stream if a.stream else diffusion
    times = mode(rank)
    if rank == 0 and times:
        print(f"median step {1000 * statistics.median(times[len(times) // 2:]):.2f} ms", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
