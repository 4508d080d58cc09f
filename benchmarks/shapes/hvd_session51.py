"""Horovod (horovod.torch) shapes of session 51, gradients shared by hand with no hvd.DistributedOptimizer (before
this session dprorun said so and profiled nothing; now runtime/gradient_calls.py): --grouped (no DistributedOptimizer: the
gradients averaged by hand with one hvd.grouped_allreduce call a step, then Adam), --async-after (an
hvd.allreduce_async_ per gradient after the backward, each synchronized before the step; SGD with momentum),
--async-hooks (the same calls made from each parameter's post-accumulate-grad hook, inside the backward: overlap by
hand), --reducescatter (ZeRO-1 by hand:
the flat gradient reduce-scattered with hvd.reducescatter, each rank's shard stepped with SGD, the parameters
all-gathered with hvd.allgather). Run with `dprorun --backend horovod -np 2 python hvd_session51.py --grouped`. (Process sets: two pairs of 4 ranks, each
pair's DistributedOptimizer given its set, failed in plain horovodrun on this Horovod 0.28.1 gloo build: "Process
set provided does not exist, or has not been registered".)"""
import argparse, statistics, time
import torch, torch.nn as nn
import horovod.torch as hvd
p = argparse.ArgumentParser(); p.add_argument("--steps", type=int, default=40)
p.add_argument("--batch-size", type=int, default=64)
for flag in ("--grouped", "--async-after", "--async-hooks", "--reducescatter"):
    p.add_argument(flag, action="store_true")
a = p.parse_args()
hvd.init()
torch.manual_seed(0); torch.set_num_threads(1)
net = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
x, y = torch.randn(a.batch_size, 256), torch.randint(0, 10, (a.batch_size,))
params = list(net.parameters())
handles = []
if a.grouped:
    opt = torch.optim.Adam(params, lr=1e-3)
elif a.async_after or a.async_hooks:
    opt = torch.optim.SGD(params, lr=0.01, momentum=0.9)
    if a.async_hooks:
        for i, q in enumerate(params):
            q.register_post_accumulate_grad_hook(
                lambda q, i=i: handles.append(hvd.allreduce_async_(q.grad, op=hvd.Average, name=f"grad.{i}")))
else:
    flat = torch.cat([q.detach().reshape(-1) for q in params])
    shard_len = -(-flat.numel() // hvd.size())
    flat = torch.cat([flat, flat.new_zeros(shard_len * hvd.size() - flat.numel())])
    shard = flat[hvd.rank() * shard_len:(hvd.rank() + 1) * shard_len].clone().requires_grad_()
    opt = torch.optim.SGD([shard], lr=0.01, momentum=0.9)
hvd.broadcast_parameters(net.state_dict(), root_rank=0)
times = []
for step in range(a.steps):
    t = time.perf_counter()
    for q in params:
        q.grad = None
    nn.functional.cross_entropy(net(x), y).backward()
    if a.grouped:
        averaged = hvd.grouped_allreduce([q.grad for q in params], op=hvd.Average, name="grads")
        for q, g in zip(params, averaged):
            q.grad = g
        opt.step()
    elif a.async_after or a.async_hooks:
        if a.async_after:
            handles = [hvd.allreduce_async_(q.grad, op=hvd.Average, name=f"grad.{i}") for i, q in enumerate(params)]
        for handle in handles:
            hvd.synchronize(handle)
        handles.clear()
        opt.step()
    else:
        grad = torch.cat([q.grad.reshape(-1) for q in params])
        grad = torch.cat([grad, grad.new_zeros(shard_len * hvd.size() - grad.numel())])
        shard.grad = hvd.reducescatter(grad, op=hvd.Average, name="grad_shard")
        opt.step()
        full = hvd.allgather(shard.detach(), name="param_shards")
        offset = 0
        with torch.no_grad():
            for q in params:
                q.copy_(full[offset:offset + q.numel()].view_as(q))
                offset += q.numel()
    times.append(time.perf_counter() - t)
if hvd.rank() == 0:
    print(f"median iteration time: {1000 * statistics.median(times[len(times) // 2:]):.3f} ms")
