"""Horovod (horovod.torch) shapes of session 42: --thread (the training loop runs in a thread of the script's, the
main thread waiting on it), --float64 (the model and its gradients in float64: 8-byte all-reduces)."""
import argparse, statistics, threading, time
import torch, torch.nn as nn
import horovod.torch as hvd
p = argparse.ArgumentParser(); p.add_argument("--steps", type=int, default=40)
for flag in ("--thread", "--float64"):
    p.add_argument(flag, action="store_true")
a = p.parse_args()
hvd.init(); torch.manual_seed(0); torch.set_num_threads(1)
dtype = torch.float64 if a.float64 else torch.float32
model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)).to(dtype)
x = torch.randn(64, 256, dtype=dtype)
y = torch.randint(0, 10, (len(x),))
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                               named_parameters=model.named_parameters())
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
times = []


def train() -> None:
    for _ in range(a.steps):
        t = time.perf_counter()
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - t)


if a.thread:
    worker = threading.Thread(target=train, name="trainer")
    worker.start()
    worker.join()
else:
    train()
if hvd.rank() == 0:
    print(f"median iteration time: {statistics.median(times[len(times)//2:]) * 1000:.3f} ms")
