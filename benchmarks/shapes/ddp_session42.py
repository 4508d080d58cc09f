"""PyTorch scripts of shapes not tuned for (session 42), one flag each; run with `dprorun -np 2 python ddp_session42.py`.

--float64: DDP of an MLP in float64 (8-byte gradients: a bucket's bytes twice its elements x 4). --bf16-params: the
same model cast to bfloat16 (2-byte gradients and buckets). --thread: the DDP training loop runs in a thread of the
script's own (as Ray Train's and some schedulers' wrappers do), the main thread waiting on it. --replicate: no
DistributedDataParallel module; the composable API's `replicate(model)` (DDP's reducer under the model's own class).
"""
import argparse, statistics, threading, time
import torch, torch.distributed as dist, torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser(); p.add_argument("--steps", type=int, default=40)
for flag in ("--float64", "--bf16-params", "--thread", "--replicate"):
    p.add_argument(flag, action="store_true")
a = p.parse_args()
dist.init_process_group("gloo"); torch.manual_seed(0); torch.set_num_threads(1)
rank, world = dist.get_rank(), dist.get_world_size()
dtype = torch.float64 if a.float64 else torch.bfloat16 if a.bf16_params else torch.float32

mlp = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)).to(dtype)
if a.replicate:
    from torch.distributed._composable.replicate import replicate

    model = replicate(mlp)
else:
    model = nn.parallel.DistributedDataParallel(mlp, bucket_cap_mb=2)
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
x, y = torch.randn(64, 256, dtype=dtype), torch.randint(0, 10, (64,))
times = []


def train() -> None:
    for _ in range(a.steps):
        t = time.perf_counter()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - t)


if a.thread:
    worker = threading.Thread(target=train, name="trainer")
    worker.start()
    worker.join()
else:
    train()
if rank == 0:
    print(f"median iteration time: {statistics.median(times[len(times)//2:]) * 1000:.3f} ms")
dist.destroy_process_group()
