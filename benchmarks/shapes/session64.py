"""Shapes not tuned for (session 64), 2 ranks: `dprorun -np 2 python session64.py --zero-in-hook` (or another mode).

--freeze-midrun: DDP(find_unused_parameters=True) over a conv trunk and an MLP head; the trunk frozen by
requires_grad_(False) at step 12 (inside the profiled window): the backward shrinks, the calls stay.
--complex: a spectral filter with complex-valued parameters (FFT, complex weights, inverse FFT) under DDP, Adam.
--join-zero: uneven inputs under Join([ddp, ZeroRedundancyOptimizer]): rank 1 runs 6 fewer steps.
--multi-grad-hook: gradients averaged by hand from torch.autograd.graph.register_multi_grad_hook, one flat async
all_reduce per layer as the layer's gradients are all ready, waited for before the SGD step.
--bn-by-hand: a BatchNorm conv net under DDP(broadcast_buffers=False), its running statistics all-reduced by hand
every 5 steps (one flat call), SGD with Nesterov momentum.
--topk: gradient compression by hand: each step all_gathers the top 1 % of the flat gradient (values and indices)
with error feedback, no DDP.
--local-sgd: no DDP: local SGD, each rank steps on its own and the parameters are averaged by hand (an all_reduce
each) every 4th step, after the optimizer's step: nothing shared between backward and step.
Rank 0 prints the median step time of the second half.
"""
import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

MODES = ("freeze_midrun", "complex", "join_zero", "multi_grad_hook", "bn_by_hand", "topk", "local_sgd")
p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=40)
for mode in MODES:
    p.add_argument("--" + mode.replace("_", "-"), action="store_true")
a = p.parse_args()


def mlp(width: int = 512, depth: int = 4) -> nn.Sequential:
    layers = [nn.Linear(128, width), nn.ReLU()]
    for _ in range(depth - 2):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def timed(step, steps: int) -> list:
    times = []
    for k in range(steps):
        t0 = time.perf_counter()
        step(k)
        times.append(time.perf_counter() - t0)
    return times


def conv_trunk(norm: bool = False) -> nn.Sequential:
    extra = [nn.BatchNorm2d(32)] if norm else []
    return nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), *extra, nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4), nn.Flatten())


def freeze_midrun(rank: int) -> list:
    trunk = conv_trunk()
    model = DDP(nn.Sequential(trunk, nn.Linear(1024, 256), nn.ReLU(), nn.Linear(256, 10)),
                find_unused_parameters=True)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.rand(32, 3, 32, 32), torch.randint(0, 10, (32,))

    def step(k: int) -> None:
        if k == 12:
            trunk.requires_grad_(False)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    return timed(step, a.steps)


class SpectralFilter(nn.Module):
    def __init__(self, length: int, channels: int):
        super().__init__()
        modes = length // 2 + 1
        self.weight = nn.Parameter(torch.randn(channels, modes, dtype=torch.cfloat) * 0.1)
        self.mix = nn.Linear(channels, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: batch, channels, length
        spectrum = torch.fft.rfft(x, dim=-1) * self.weight
        h = torch.fft.irfft(spectrum, n=x.shape[-1], dim=-1)
        return F.gelu(self.mix(h.transpose(1, 2)).transpose(1, 2)) + x


def complex(rank: int) -> list:
    net = nn.Sequential(*[SpectralFilter(256, 64) for _ in range(4)], nn.Flatten(), nn.Linear(64 * 256, 10))
    model = DDP(net)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.randn(32, 64, 256), torch.randint(0, 10, (32,))

    def step(k: int) -> None:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    return timed(step, a.steps)


def join_zero(rank: int) -> list:
    from torch.distributed.algorithms.join import Join
    from torch.distributed.optim import ZeroRedundancyOptimizer

    model = DDP(mlp())
    zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3)
    x, y = torch.randn(64, 128), torch.randint(0, 10, (64,))
    mine = a.steps - 6 * rank
    times = []
    with Join([model, zero]):
        for _ in range(mine):
            t0 = time.perf_counter()
            zero.zero_grad()
            F.cross_entropy(model(x), y).backward()
            zero.step()
            times.append(time.perf_counter() - t0)
    return times


def multi_grad_hook(rank: int) -> list:
    model = mlp(depth=6)
    layers = [m for m in model if isinstance(m, nn.Linear)]
    world = dist.get_world_size()
    pending = []

    def reduce_layer(layer: nn.Linear):
        def hook(grads) -> None:
            flat = torch.cat([g.reshape(-1) for g in grads]) / world
            pending.append((layer, flat, dist.all_reduce(flat, async_op=True)))
        return hook

    for layer in layers:
        torch.autograd.graph.register_multi_grad_hook([layer.weight, layer.bias], reduce_layer(layer))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.randn(64, 128), torch.randint(0, 10, (64,))

    def step(k: int) -> None:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        for layer, flat, work in pending:
            work.wait()
            n = layer.weight.numel()
            layer.weight.grad.copy_(flat[:n].view_as(layer.weight))
            layer.bias.grad.copy_(flat[n:].view_as(layer.bias))
        pending.clear()
        opt.step()

    return timed(step, a.steps)


def bn_by_hand(rank: int) -> list:
    net = nn.Sequential(conv_trunk(norm=True), nn.Linear(1024, 10))
    model = DDP(net, broadcast_buffers=False)
    stats = [b for name, b in net.named_buffers() if "running" in name]
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True)
    world = dist.get_world_size()
    x, y = torch.rand(32, 3, 32, 32), torch.randint(0, 10, (32,))

    def step(k: int) -> None:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        if k % 5 == 4:
            flat = torch.cat([b.reshape(-1) for b in stats])
            dist.all_reduce(flat)
            flat /= world
            offset = 0
            for b in stats:
                b.copy_(flat[offset:offset + b.numel()].view_as(b))
                offset += b.numel()

    return timed(step, a.steps)


def topk(rank: int) -> list:
    model = mlp(width=768)
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.01)
    world = dist.get_world_size()
    total = sum(q.numel() for q in params)
    k = max(1, total // 100)
    residual = torch.zeros(total)
    x, y = torch.randn(64, 128), torch.randint(0, 10, (64,))

    def step(_: int) -> None:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        flat = torch.cat([q.grad.reshape(-1) for q in params]) + residual
        values, indices = flat.abs().topk(k)
        values = flat[indices]
        residual.copy_(flat)
        residual[indices] = 0
        all_values = [torch.empty_like(values) for _ in range(world)]
        all_indices = [torch.empty_like(indices) for _ in range(world)]
        dist.all_gather(all_values, values)
        dist.all_gather(all_indices, indices)
        dense = torch.zeros(total)
        for v, i in zip(all_values, all_indices):
            dense.index_add_(0, i, v)
        dense /= world
        offset = 0
        for q in params:
            q.grad.copy_(dense[offset:offset + q.numel()].view_as(q))
            offset += q.numel()
        opt.step()

    return timed(step, a.steps)


def local_sgd(rank: int) -> list:
    model = mlp(width=768)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    world = dist.get_world_size()
    x, y = torch.randn(64, 128), torch.randint(0, 10, (64,))

    def step(k: int) -> None:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        if k % 4 == 3:
            with torch.no_grad():
                for q in model.parameters():
                    dist.all_reduce(q)
                    q /= world

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
