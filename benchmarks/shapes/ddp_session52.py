"""PyTorch shapes not tuned for (session 52): `dprorun -np 2 python ddp_session52.py --own-optimizer`.

--own-optimizer: DDP stepped by an optimizer class of the script's own that is no torch.optim.Optimizer (a Lion
written as research code often is: a plain class with step() and zero_grad()), a pre-norm MLP block stack.
--manual-sgd: DDP and no optimizer object at all: SGD with momentum applied in place under no_grad, the gradients
cleared by model.zero_grad().
--funcol: no DDP; the gradients averaged by hand with torch's functional collectives
(torch.distributed._functional_collectives.all_reduce, one call per parameter, its result waited for where it is
copied back), AdamW.
--by-hand-manual: no DDP and no optimizer object: each gradient all-reduced by torch.distributed.all_reduce after
the backward, then SGD applied in place (the classic "average_gradients" tutorial loop with its update by hand).
--monitored-barrier: DDP with a torch.distributed.monitored_barrier every 10 steps (gloo's barrier that names a
missing rank: point-to-point messages under the hood), SGD.
--eval-mode: DDP of a model trained in eval mode (model.eval() once before the loop, as scripts that keep dropout
and BatchNorm statistics fixed while fine-tuning do: DDP still all-reduces the gradients), SGD.
--mixed-dtype: DDP of a model whose trunk holds bfloat16 parameters and whose head holds float32 ones (DDP buckets
each dtype apart), the trunk's output cast up; Adam.
"""
import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

p = argparse.ArgumentParser()
for flag in ("--own-optimizer", "--manual-sgd", "--funcol", "--by-hand-manual", "--monitored-barrier",
             "--mixed-dtype", "--eval-mode"):
    p.add_argument(flag, action="store_true")
p.add_argument("--steps", type=int, default=60)
a = p.parse_args()
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


class Lion:
    """Lion (sign of an interpolated momentum), as a plain class: no torch.optim.Optimizer, so none of its hooks."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.01):
        self.params = [q for q in params if q.requires_grad]
        self.lr, self.betas, self.weight_decay = lr, betas, weight_decay
        self.momentum = [torch.zeros_like(q) for q in self.params]

    @torch.no_grad()
    def step(self):
        b1, b2 = self.betas
        for q, m in zip(self.params, self.momentum):
            if q.grad is None:
                continue
            q.mul_(1 - self.lr * self.weight_decay)
            q.add_(torch.sign(m * b1 + q.grad * (1 - b1)), alpha=-self.lr)
            m.mul_(b2).add_(q.grad, alpha=1 - b2)

    def zero_grad(self):
        for q in self.params:
            q.grad = None


class MixedDtype(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU()).to(torch.bfloat16)
        self.head = nn.Sequential(nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 10))

    def forward(self, x):
        return self.head(self.trunk(x.to(torch.bfloat16)).float())


net = MixedDtype() if a.mixed_dtype else nn.Sequential(nn.Linear(256, 384), *[Block(384) for _ in range(4)],
                                                       nn.Linear(384, 10))
x, y = torch.randn(128, 256), torch.randint(0, 10, (128,))
model = net if a.funcol or a.by_hand_manual else DDP(net)
loss_fn = nn.CrossEntropyLoss()
if a.eval_mode:
    model.eval()
if a.funcol or a.by_hand_manual:
    for q in net.parameters():  # the same start on every rank, as DDP's construction would give
        dist.broadcast(q.data, src=0)
if a.own_optimizer:
    opt = Lion(model.parameters())
elif a.manual_sgd or a.by_hand_manual:
    opt = None
    velocity = [torch.zeros_like(q) for q in model.parameters()]
elif a.funcol:
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=0.01)
elif a.mixed_dtype:
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
else:
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

def average_by_funcol() -> None:
    import torch.distributed._functional_collectives as funcol

    averaged = [funcol.all_reduce(q.grad, "sum", dist.group.WORLD) for q in net.parameters() if q.grad is not None]
    grads = [q.grad for q in net.parameters() if q.grad is not None]
    for grad, total in zip(grads, averaged):
        grad.copy_(total / world)


times = []
for step in range(a.steps):
    start = time.perf_counter()
    if opt is None:
        model.zero_grad(set_to_none=True)
    else:
        opt.zero_grad()
    loss = loss_fn(model(x), y)
    loss.backward()
    if a.funcol:
        average_by_funcol()
    if a.by_hand_manual:
        for q in net.parameters():
            dist.all_reduce(q.grad)
            q.grad /= world
    if opt is None:
        with torch.no_grad():
            for q, v in zip(model.parameters(), velocity):
                v.mul_(0.9).add_(q.grad)
                q.sub_(v, alpha=0.05)
    else:
        opt.step()
    if a.monitored_barrier and step % 10 == 9:
        dist.monitored_barrier()
    times.append(time.perf_counter() - start)
if a.funcol or a.by_hand_manual:  # the ranks' copies stayed one model (averaged gradients, the same updates)
    first = next(net.parameters()).detach().clone()
    dist.broadcast(first, src=0)
    assert torch.allclose(first, next(net.parameters()).detach()), "the ranks' parameters drifted apart"
if rank == 0:
    print(f"median step {1000 * statistics.median(times[10:]):.2f} ms, loss {loss.item():.4f}", flush=True)
dist.destroy_process_group()
