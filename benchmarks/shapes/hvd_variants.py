"""Horovod (horovod.torch) variants of an MLP with Adam: --fp16 compression, --metric (hvd.allreduce of the loss
every step), --sync (opt.synchronize(), clipping, then step() inside skip_synchronize). (Adasum is left out: this
Horovod build has no Adasum operation, under horovodrun too.)"""
import argparse, statistics, time
import torch, torch.nn as nn
import horovod.torch as hvd
p = argparse.ArgumentParser(); p.add_argument("--steps", type=int, default=40)
for f in ("fp16", "metric", "sync"): p.add_argument("--" + f, action="store_true")
a = p.parse_args()
hvd.init(); torch.manual_seed(0); torch.set_num_threads(1)
model = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
opt = torch.optim.Adam(model.parameters(), lr=1e-4)
opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                               compression=hvd.Compression.fp16 if a.fp16 else hvd.Compression.none,
                               op=hvd.Average)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(opt, root_rank=0)
x = torch.randn(64, 512); y = torch.randint(0, 10, (64,))
times = []
for step in range(a.steps):
    t = time.perf_counter()
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    if a.sync:
        opt.synchronize()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        with opt.skip_synchronize():
            opt.step()
    else:
        opt.step()
    if a.metric:
        hvd.allreduce(loss.detach(), name="loss")
    times.append(time.perf_counter() - t)
if hvd.rank() == 0:
    print(f"median iteration time: {statistics.median(times[len(times)//2:]) * 1000:.3f} ms")
