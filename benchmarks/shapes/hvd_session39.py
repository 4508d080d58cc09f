"""Horovod (horovod.torch) shapes of session 39: --join-uneven (rank 1 has 6 batches fewer, as an uneven last
shard: it calls hvd.join() when its data ends and the others' all-reduces go on without it; every rank joins at
the end), --torchscript (a torch.jit.script'ed model: no forward hook on it). (hvd.SyncBatchNorm was tried: it
raises "expected input tensor to be on GPU" on CPU.)"""
import argparse, statistics, time
import torch, torch.nn as nn
import horovod.torch as hvd
p = argparse.ArgumentParser(); p.add_argument("--steps", type=int, default=40)
for flag in ("--join-uneven", "--torchscript"):
    p.add_argument(flag, action="store_true")
a = p.parse_args()
hvd.init(); torch.manual_seed(0); torch.set_num_threads(1)
model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
if a.torchscript:
    model = torch.jit.script(model)
x = torch.randn(64, 256)
y = torch.randint(0, 10, (len(x),))
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                               named_parameters=model.named_parameters())
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
steps = a.steps - 6 if a.join_uneven and hvd.rank() == 1 else a.steps
times = []
for step in range(steps):
    t = time.perf_counter()
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    times.append(time.perf_counter() - t)
if a.join_uneven:
    hvd.join()
if hvd.rank() == 0:
    print(f"median iteration time: {statistics.median(times[len(times)//2:]) * 1000:.3f} ms")
