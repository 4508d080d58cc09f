"""Horovod (horovod.torch) shapes of session 43: --compiled (the model torch.compile'd before
hvd.DistributedOptimizer hooks its parameters), --broadcast-object (rank 0's augmentation seed sent to every rank with
hvd.broadcast_object before each step, named: its default name is the object's type, None on the other ranks, and
Horovod waits for good on two names)."""
import argparse, random, statistics, time
import torch, torch.nn as nn
import horovod.torch as hvd
p = argparse.ArgumentParser(); p.add_argument("--steps", type=int, default=40)
for flag in ("--compiled", "--broadcast-object"):
    p.add_argument(flag, action="store_true")
a = p.parse_args()
hvd.init(); torch.manual_seed(0); torch.set_num_threads(1)
net = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
model = torch.compile(net) if a.compiled else net
x = torch.randn(64, 256)
y = torch.randint(0, 10, (len(x),))
opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9),
                               named_parameters=net.named_parameters())
hvd.broadcast_parameters(net.state_dict(), root_rank=0)
times = []
for _ in range(a.steps):
    t = time.perf_counter()
    if a.broadcast_object:
        seed = hvd.broadcast_object(random.randrange(1 << 30) if hvd.rank() == 0 else None, root_rank=0, name="seed")
        xb = x + 0.01 * torch.randn(x.shape, generator=torch.Generator().manual_seed(seed))
    else:
        xb = x
    opt.zero_grad()
    nn.functional.cross_entropy(model(xb), y).backward()
    opt.step()
    times.append(time.perf_counter() - t)
if hvd.rank() == 0:
    print(f"median iteration time: {statistics.median(times[len(times)//2:]) * 1000:.3f} ms")
