"""horovod.torch shapes of session 34: --groups: DistributedOptimizer(groups=2) (grouped all-reduces);
--broadcast-every: the parameters broadcast from rank 0 every 10 steps (a resync some scripts do);
--conv-sgd: a conv net with BatchNorm, SGD, momentum and weight decay (channels_last is left out: Horovod refuses
its non-contiguous tensors, "Tensor is required to be contiguous", under horovodrun too)."""
import argparse, statistics, time
import torch, torch.nn as nn
import horovod.torch as hvd
p = argparse.ArgumentParser(); p.add_argument("--steps", type=int, default=40)
for f in ("groups", "broadcast-every", "conv-sgd"): p.add_argument("--" + f, action="store_true")
a = p.parse_args()
hvd.init(); torch.manual_seed(0); torch.set_num_threads(1)
if a.conv_sgd:
    model = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.Conv2d(32, 64, 3, stride=2),
                          nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))
    x = torch.randn(32, 3, 32, 32)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
else:
    model = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
    x = torch.randn(64, 512)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
y = torch.randint(0, 10, (x.shape[0],))
opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), groups=2 if a.groups else None)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(opt, root_rank=0)
times = []
for step in range(a.steps):
    t = time.perf_counter()
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    if a.broadcast_every and step % 10 == 9:
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    times.append(time.perf_counter() - t)
if hvd.rank() == 0:
    print(f"median iteration time: {statistics.median(times[len(times)//2:]) * 1000:.3f} ms")
