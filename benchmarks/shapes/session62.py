"""Shapes not tuned for (session 62), 2 ranks: `dprorun -np 2 python session62.py --token-budget` (or another mode).

--token-budget: sequences of random lengths packed into micro-batches under a token budget; an optimizer step
accumulates as many micro-batches as its share of the corpus needs (1 to 3, the count agreed over ranks with an
all-reduce of MAX every step), no_sync on all but the last; a GRU language model, AdamW.
--subgroup: DDP over a process group the script made itself (dist.new_group of every rank, gloo) while the loss
is averaged over the default group every step for logging; a conv net, SGD with Nesterov momentum.
--tbptt: truncated backpropagation through time: an LSTM language model whose hidden state is carried from step to
step (detached), clip_grad_value_, SGD with CosineAnnealingWarmRestarts stepped every optimizer step.
--lazy: a model of lazy modules (LazyConv2d, LazyLinear) materialised by a dry forward before DDP wraps it, RMSprop,
an ExponentialLR stepped every 10 steps.
--alternating: an encoder and a decoder trained on alternate steps (the other half's requires_grad off), DDP with
find_unused_parameters=True, one Adam over both.
--pgd: adversarial training: three PGD steps a step (the attack's forwards under no_sync, the input's gradient by
torch.autograd.grad, no parameter gradient), then the training forward and backward on the perturbed batch; a conv
net, SGD with momentum.
Rank 0 prints the median step time of the second half.
"""
import argparse
import contextlib
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=40)
for flag in ("--token-budget", "--subgroup", "--tbptt", "--lazy", "--alternating", "--pgd"):
    p.add_argument(flag, action="store_true")
a = p.parse_args()
VOCAB = 500


class GRULM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 64)
        self.gru = nn.GRU(64, 128, batch_first=True)
        self.out = nn.Linear(128, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(self.gru(self.embed(tokens))[0])


def token_budget(rank: int) -> list:
    model = DDP(GRULM())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(rank)
    times = []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        want = torch.tensor([int(torch.randint(1, 4, (1,), generator=gen))])
        dist.all_reduce(want, op=dist.ReduceOp.MAX)  # every rank runs as many micro-batches
        opt.zero_grad()
        for k in range(int(want)):
            length = int(torch.randint(16, 48, (1,), generator=gen))
            tokens = torch.randint(0, VOCAB, (max(1, 1024 // length), length + 1), generator=gen)
            with model.no_sync() if k < int(want) - 1 else contextlib.nullcontext():
                loss = F.cross_entropy(model(tokens[:, :-1]).reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
                (loss / int(want)).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    return times


def conv_net() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, stride=2, padding=1),
                         nn.ReLU(), nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(512, 10))


def subgroup(rank: int) -> list:
    group = dist.new_group(ranks=list(range(dist.get_world_size())), backend="gloo")
    model = DDP(conv_net(), process_group=group)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True)
    x, y = torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,))
    times = []
    for step in range(a.steps):
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        logged = loss.detach().clone()
        dist.all_reduce(logged)  # the default group, not DDP's
        if rank == 0 and step % 10 == 0:
            print(f"step {step} loss {float(logged) / dist.get_world_size():.4f}", flush=True)
        times.append(time.perf_counter() - t0)
    return times


def tbptt(rank: int) -> list:
    class LSTMLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(VOCAB, 64)
            self.lstm = nn.LSTM(64, 128, num_layers=2, batch_first=True)
            self.out = nn.Linear(128, VOCAB)

        def forward(self, tokens, state):
            hidden, state = self.lstm(self.embed(tokens), state)
            return self.out(hidden), state

    model = DDP(LSTMLM())
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    sched = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=8, T_mult=2)
    stream = torch.randint(0, VOCAB, (16, a.steps * 24 + 1), generator=torch.Generator().manual_seed(rank))
    state = None
    times = []
    for step in range(a.steps):
        t0 = time.perf_counter()
        chunk = stream[:, step * 24: step * 24 + 25]
        if state is not None:
            state = tuple(s.detach() for s in state)
        logits, state = model(chunk[:, :-1], state)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), chunk[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        nn.utils.clip_grad_value_(model.parameters(), 0.5)
        opt.step()
        sched.step()
        times.append(time.perf_counter() - t0)
    return times


def lazy(rank: int) -> list:
    net = nn.Sequential(nn.LazyConv2d(16, 3, padding=1), nn.ReLU(), nn.LazyConv2d(32, 3, padding=1), nn.ReLU(),
                        nn.MaxPool2d(2), nn.Flatten(), nn.LazyLinear(64), nn.ReLU(), nn.LazyLinear(10))
    x, y = torch.randn(16, 3, 24, 24), torch.randint(0, 10, (16,))
    with torch.no_grad():
        net(x[:2])  # materialise the lazy parameters before DDP registers them
    model = DDP(net)
    opt = torch.optim.RMSprop(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)
    times = []
    for step in range(a.steps):
        t0 = time.perf_counter()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        if step % 10 == 9:
            sched.step()
        times.append(time.perf_counter() - t0)
    return times


def alternating(rank: int) -> list:
    encoder = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 64))
    decoder = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 256))
    model = DDP(nn.Sequential(encoder, decoder), find_unused_parameters=True)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(64, 256)
    times = []
    for step in range(a.steps):
        t0 = time.perf_counter()
        train_encoder = step % 2 == 0
        encoder.requires_grad_(train_encoder)
        decoder.requires_grad_(not train_encoder)
        opt.zero_grad()
        F.mse_loss(model(x), x).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    return times


def pgd(rank: int) -> list:
    model = DDP(conv_net())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = torch.rand(32, 3, 32, 32), torch.randint(0, 10, (32,))
    times = []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        delta = torch.zeros_like(x).uniform_(-8 / 255, 8 / 255).requires_grad_(True)
        for _ in range(3):  # the attack: no gradient sync, the input's gradient only
            with model.no_sync():
                grad, = torch.autograd.grad(F.cross_entropy(model(x + delta), y), delta)
            delta = (delta + 2 / 255 * grad.sign()).clamp(-8 / 255, 8 / 255).detach().requires_grad_(True)
        opt.zero_grad()
        F.cross_entropy(model((x + delta).clamp(0, 1)), y).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mode = next(m for m in ("token_budget", "subgroup", "tbptt", "lazy", "alternating", "pgd") if getattr(a, m))
    times = globals()[mode](rank)
    if rank == 0:
        print(f"median iteration time: {statistics.median(times[len(times) // 2:]) * 1000:.3f} ms")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
