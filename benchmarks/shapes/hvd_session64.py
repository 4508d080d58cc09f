"""Horovod (horovod.torch) shapes of session 64, 2 ranks: --process-set (hvd.init with process sets: the
DistributedOptimizer given the global process set explicitly, a metric all-reduced each step in a set of rank 0
alone and one of rank 1 alone), --average-every-4 (no DistributedOptimizer: local SGD, the parameters averaged by
hvd.allreduce_ every 4th step after the optimizer's step; nothing shared between backward and step), --topk (no
DistributedOptimizer: each step hvd.allgather's every rank's top 1 % of the flat gradient, values and indices, with
error feedback, between the backward and the step)."""
import argparse, statistics, time
import torch, torch.nn as nn
import horovod.torch as hvd
p = argparse.ArgumentParser(); p.add_argument("--steps", type=int, default=40)
for flag in ("--process-set", "--average-every-4", "--topk"):
    p.add_argument(flag, action="store_true")
a = p.parse_args()
if a.process_set:
    alone = [hvd.ProcessSet([0]), hvd.ProcessSet([1])]
    hvd.init(process_sets=alone)
    every = hvd.global_process_set
else:
    hvd.init()
torch.manual_seed(0); torch.set_num_threads(1)
model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
base = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
params = list(model.parameters())
total = sum(q.numel() for q in params)
residual = torch.zeros(total)
opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(), process_set=every) \
    if a.process_set else base
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
times = []
for step in range(a.steps):
    t = time.perf_counter()
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    if a.topk:
        flat = torch.cat([q.grad.reshape(-1) for q in params]) + residual
        indices = flat.abs().topk(total // 100).indices
        values = flat[indices]
        residual.copy_(flat)
        residual[indices] = 0
        dense = torch.zeros(total).index_add_(0, hvd.allgather(indices, name="idx"),
                                              hvd.allgather(values, name="val")) / hvd.size()
        offset = 0
        for q in params:
            q.grad.copy_(dense[offset:offset + q.numel()].view_as(q))
            offset += q.numel()
    opt.step()
    if a.process_set:
        hvd.allreduce(loss.detach(), name="loss", process_set=alone[hvd.rank()])
    elif step % 4 == 3:
        for q in model.parameters():
            hvd.allreduce_(q.data, op=hvd.Average)
    times.append(time.perf_counter() - t)
hvd.join()  # no rank shuts Horovod down while another's last call in its own process set is under way
if hvd.rank() == 0:
    print(f"median iteration time: {statistics.median(times[len(times)//2:]) * 1000:.3f} ms")
