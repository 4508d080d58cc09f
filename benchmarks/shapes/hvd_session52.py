"""Horovod (horovod.torch) shapes of session 52: --frozen-trunk (fine-tuning: a conv trunk with requires_grad off,
the DistributedOptimizer given only the head's parameters, AdamW), --dynamic-branch (one of two heads drawn each step
from a seeded generator the ranks share: the other head's gradients missing at the step, which Horovod all-reduces
as zeros in synchronize()), --frozen-after (the trunk frozen after 15 steps by requires_grad_(False), the optimizer
left as built: Horovod's hooks stop firing for it), --eval-mode (the model trained in eval mode: model.eval() once,
as fine-tuning scripts keep dropout off and BatchNorm's statistics fixed)."""
import argparse, statistics, time
import torch, torch.nn as nn
import horovod.torch as hvd
p = argparse.ArgumentParser(); p.add_argument("--steps", type=int, default=40)
for flag in ("--frozen-trunk", "--dynamic-branch", "--frozen-after", "--eval-mode"):
    p.add_argument(flag, action="store_true")
a = p.parse_args()
hvd.init(); torch.manual_seed(0); torch.set_num_threads(1)
trunk = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
                      nn.AdaptiveAvgPool2d(4), nn.Flatten())
heads = nn.ModuleList([nn.Sequential(nn.Linear(1024, 512), nn.ReLU(), nn.Linear(512, 10)) for _ in range(2)])
model = nn.ModuleDict({"trunk": trunk, "heads": heads})
x, y = torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,))
if a.frozen_trunk:
    trunk.requires_grad_(False)
    trainable = [(n, q) for n, q in model.named_parameters() if q.requires_grad]
    base = torch.optim.AdamW([q for _, q in trainable], lr=1e-3)
else:
    trainable = list(model.named_parameters())
    base = torch.optim.SGD([q for _, q in trainable], lr=0.01, momentum=0.9)
opt = hvd.DistributedOptimizer(base, named_parameters=trainable)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
if a.eval_mode:
    model.eval()
draw = torch.Generator().manual_seed(1234)  # the same draws on every rank
times = []
for step in range(a.steps):
    t = time.perf_counter()
    if a.frozen_after and step == 15:
        trunk.requires_grad_(False)
    opt.zero_grad()
    head = int(torch.randint(0, 2, (1,), generator=draw)) if a.dynamic_branch else 0
    nn.functional.cross_entropy(heads[head](trunk(x)), y).backward()
    opt.step()
    times.append(time.perf_counter() - t)
if hvd.rank() == 0:
    print(f"median iteration time: {statistics.median(times[len(times)//2:]) * 1000:.3f} ms")
