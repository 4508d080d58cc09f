"""Shapes not tuned for (session 57), 2 ranks: `dprorun -np 2 python session57.py --gradient-penalty` (or another mode).

--gradient-penalty: a WGAN-GP critic step: the critic (DDP) scores real and mixed samples, the penalty is the
gradient norm of its score with respect to the mixed inputs (torch.autograd.grad with create_graph=True, a double
backward through the critic), added to the loss before backward().
--experts: a mixture of 4 experts under DDP(find_unused_parameters=True); each rank's batches route to the experts
of its own rank's choice (top-1 of a gate biased per rank), so the experts a rank leaves unused differ per rank and
per step.
--parametrized: weight normalisation through torch.nn.utils.parametrizations.weight_norm on every Linear, and an L1
pruning mask (torch.nn.utils.prune: a forward pre-hook recomputing the weight) on the first: the parameters DDP
buckets are the parametrizations' original0/original1 and the pruned weight_orig.
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

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=40)
p.add_argument("--gradient-penalty", action="store_true")
p.add_argument("--experts", action="store_true")
p.add_argument("--parametrized", action="store_true")
a = p.parse_args()


class Experts(nn.Module):
    def __init__(self, width: int = 256, count: int = 4):
        super().__init__()
        self.gate = nn.Linear(width, count)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
                                     for _ in range(count))
        self.head = nn.Linear(width, 10)

    def forward(self, x, bias):
        choice = (self.gate(x) + bias).argmax(dim=1)
        out = torch.zeros_like(x)
        for index, expert in enumerate(self.experts):
            picked = choice == index
            if picked.any():
                out[picked] = expert(x[picked])
        return self.head(out)


def critic_step(model, opt, real):
    fake = torch.randn_like(real)
    mix = torch.rand(real.shape[0], 1)
    mixed = (mix * real + (1 - mix) * fake).requires_grad_(True)
    score = model(mixed)
    grad, = torch.autograd.grad(score.sum(), mixed, create_graph=True)
    penalty = ((grad.norm(2, dim=1) - 1) ** 2).mean()
    loss = model(fake).mean() - model(real).mean() + 10 * penalty
    opt.zero_grad()
    loss.backward()
    opt.step()


def main() -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    rank = dist.get_rank()
    if a.gradient_penalty:
        model = DDP(nn.Sequential(nn.Linear(128, 512), nn.LeakyReLU(0.2), nn.Linear(512, 512), nn.LeakyReLU(0.2),
                                  nn.Linear(512, 1)))
        opt = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.0, 0.9))
        real = torch.randn(64, 128)
        step = lambda index: critic_step(model, opt, real)  # noqa: E731
    elif a.experts:
        model = DDP(Experts(), find_unused_parameters=True)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))

        def step(index):
            bias = torch.full((4,), -5.0)
            bias[(rank + index) % 4] = 5.0  # this rank's batch goes to one expert, another one next step
            opt.zero_grad()
            F.cross_entropy(model(x, bias), y).backward()
            opt.step()
    else:
        from torch.nn.utils import prune
        from torch.nn.utils.parametrizations import weight_norm

        net = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), weight_norm(nn.Linear(512, 512)), nn.ReLU(),
                            weight_norm(nn.Linear(512, 10)))
        prune.l1_unstructured(net[0], name="weight", amount=0.3)
        model = DDP(net)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))

        def step(index):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    times = []
    for index in range(a.steps):
        start = time.perf_counter()
        step(index)
        times.append(time.perf_counter() - start)
    if rank == 0:
        print(f"median iteration time: {1000 * statistics.median(times[len(times) // 2:]):.2f} ms")
    dist.barrier()
    model = None  # the wrapper, and with it its hold on the group, let go before the teardown
    dist.destroy_process_group()


main()
