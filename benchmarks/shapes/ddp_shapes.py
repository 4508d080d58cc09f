"""DDP shapes: --accum K with no_sync, --unused (find_unused_parameters + a branch used every other step),
--static (static_graph), --bucket-view (gradient_as_bucket_view), --amp (bf16 autocast)."""
import argparse, contextlib, statistics, time
import torch, torch.distributed as dist, torch.nn as nn
p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=40); p.add_argument("--accum", type=int, default=1)
p.add_argument("--unused", action="store_true"); p.add_argument("--static", action="store_true")
p.add_argument("--bucket-view", action="store_true"); p.add_argument("--amp", action="store_true")
a = p.parse_args()
dist.init_process_group("gloo"); torch.manual_seed(0); torch.set_num_threads(1)
class Net(nn.Module):
    def __init__(s, aux):
        super().__init__()
        s.trunk = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
                                nn.AdaptiveAvgPool2d(4), nn.Flatten())
        s.head = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 10))
        s.aux = nn.Linear(512, 10) if aux else None
    def forward(s, x, use_aux=False):
        h = s.trunk(x)
        out = s.head(h)
        return out + s.aux(h) if use_aux else out
model = Net(a.unused)
ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=a.unused, static_graph=a.static,
                                          gradient_as_bucket_view=a.bucket_view, bucket_cap_mb=1)
opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
x = torch.randn(16, 3, 32, 32); y = torch.randint(0, 10, (16,))
times = []
for step in range(a.steps):
    t = time.perf_counter()
    opt.zero_grad()
    for k in range(a.accum):
        ctx = ddp.no_sync() if k < a.accum - 1 else contextlib.nullcontext()
        with ctx:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.amp):
                out = ddp(x, use_aux=a.unused and step % 2 == 0) if a.unused else ddp(x)
                loss = nn.functional.cross_entropy(out.float(), y)
            loss.backward()
    opt.step()
    times.append(time.perf_counter() - t)
if dist.get_rank() == 0:
    tail = times[len(times) // 2:]
    print(f"median iteration time: {statistics.median(tail) * 1000:.3f} ms")
dist.destroy_process_group()
