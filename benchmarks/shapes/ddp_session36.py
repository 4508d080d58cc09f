"""DDP shapes of session 36. --two-optimizers: a recommendation model (a sparse EmbeddingBag and an MLP) with an
optimizer each, SparseAdam for the table and AdamW for the rest, stepped one after the other every step.
--channels-last: a conv net in channels_last memory format, SGD with Nesterov momentum and a warm-up then cosine
LambdaLR schedule."""
import argparse, math, statistics, time
import torch, torch.distributed as dist, torch.nn as nn
p = argparse.ArgumentParser(); p.add_argument("--steps", type=int, default=40)
p.add_argument("--two-optimizers", action="store_true"); p.add_argument("--channels-last", action="store_true")
a = p.parse_args()
dist.init_process_group("gloo"); torch.manual_seed(0); torch.set_num_threads(1)
DDP = nn.parallel.DistributedDataParallel
times = []
if a.two_optimizers:
    class Rec(nn.Module):
        def __init__(self):
            super().__init__()
            self.table = nn.EmbeddingBag(50000, 32, mode="sum", sparse=True)
            self.mlp = nn.Sequential(nn.Linear(32 + 64, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(),
                                     nn.Linear(256, 1))

        def forward(self, ids, dense):
            return self.mlp(torch.cat([self.table(ids), dense], 1))

    model = DDP(Rec())
    sparse_opt = torch.optim.SparseAdam(list(model.module.table.parameters()), lr=1e-3)
    dense_opt = torch.optim.AdamW(model.module.mlp.parameters(), lr=1e-3)
    ids, dense, y = torch.randint(0, 50000, (128, 16)), torch.randn(128, 64), torch.rand(128, 1)

    def step_fn():
        sparse_opt.zero_grad(); dense_opt.zero_grad()
        nn.functional.binary_cross_entropy_with_logits(model(ids, dense), y).backward()
        sparse_opt.step(); dense_opt.step()
elif a.channels_last:
    net = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1),
                        nn.BatchNorm2d(64), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))
    model = DDP(net.to(memory_format=torch.channels_last))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-4)
    warm = 5
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / a.steps)))
    x = torch.randn(32, 3, 32, 32).to(memory_format=torch.channels_last); y = torch.randint(0, 10, (32,))

    def step_fn():
        opt.zero_grad(); nn.functional.cross_entropy(model(x), y).backward(); opt.step(); sched.step()
else:
    raise SystemExit("choose a shape")
for step in range(a.steps):
    t = time.perf_counter(); step_fn(); times.append(time.perf_counter() - t)
if dist.get_rank() == 0:
    print(f"median iteration time: {statistics.median(times[len(times)//2:]) * 1000:.3f} ms")
