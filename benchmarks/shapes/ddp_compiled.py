"""DDP compiled by the script itself: torch.compile(DDP(model)) (dynamo's DDPOptimizer splits the graph at the
buckets), AdamW, bucket_cap_mb 1."""
import argparse, statistics, time
import torch, torch.distributed as dist, torch.nn as nn
p = argparse.ArgumentParser(); p.add_argument("--steps", type=int, default=40); a = p.parse_args()
dist.init_process_group("gloo"); torch.manual_seed(0); torch.set_num_threads(1)
model = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(512, 512), nn.GELU())], nn.Linear(512, 10))
ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1)
compiled = torch.compile(ddp)
opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
x = torch.randn(64, 512); y = torch.randint(0, 10, (64,))
times = []
for step in range(a.steps):
    t = time.perf_counter()
    opt.zero_grad()
    nn.functional.cross_entropy(compiled(x), y).backward()
    opt.step()
    times.append(time.perf_counter() - t)
if dist.get_rank() == 0:
    print(f"median iteration time: {statistics.median(times[len(times) // 2:]) * 1000:.3f} ms")
dist.destroy_process_group()
