"""Horovod (horovod.torch): a conv net stepping once per --accum backward passes (backward_passes_per_step);
--sparse adds an EmbeddingBag with sparse gradients (Horovod all-gathers their rows unless sparse_as_dense)."""
import argparse, statistics, time
import torch, torch.nn as nn
import horovod.torch as hvd
p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=40)
p.add_argument("--accum", type=int, default=2)
p.add_argument("--sparse", action="store_true")
a = p.parse_args()
hvd.init(); torch.manual_seed(0); torch.set_num_threads(1)


class Net(nn.Module):
    def __init__(s):
        super().__init__()
        s.trunk = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
                                nn.AdaptiveAvgPool2d(4), nn.Flatten())
        s.emb = nn.EmbeddingBag(20000, 64, mode="sum", sparse=True) if a.sparse else None
        s.head = nn.Sequential(nn.Linear(512 + (64 if a.sparse else 0), 1024), nn.ReLU(), nn.Linear(1024, 10))

    def forward(s, x, ids):
        h = s.trunk(x)
        return s.head(torch.cat([h, s.emb(ids)], dim=1) if s.emb is not None else h)


model = Net()
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), backward_passes_per_step=a.accum)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
x = torch.randn(16, 3, 32, 32); y = torch.randint(0, 10, (16,)); ids = torch.randint(0, 20000, (16, 8))
times = []
for step in range(a.steps):
    t = time.perf_counter()
    opt.zero_grad()
    for k in range(a.accum):
        loss = nn.functional.cross_entropy(model(x, ids), y)
        loss.backward()
    opt.step()
    times.append(time.perf_counter() - t)
if hvd.rank() == 0:
    print(f"median iteration time: {statistics.median(times[len(times)//2:]) * 1000:.3f} ms")
