"""An optimizer sharded by hand (ZeRO stage 1/2 without a library, session 46): the gradients reduce-scattered, each
rank stepping AdamW on its shard, the parameters all-gathered after the step; run with
`dprorun -np 2 python zero_by_hand.py --style tensor`.

--style tensor: one flat gradient buffer, reduce_scatter_tensor, all_gather_into_tensor.
--style list: the list forms, reduce_scatter(output, chunks) and all_gather(chunks, shard).
--style groups: the model's parameters in groups of about 1 MB, each group reduce-scattered and all-gathered on its
own (several of each a step), through torch 2.13's reduce_scatter_single and all_gather_single (the names the
tensor style's calls are deprecated for; the tensor style's where torch lacks them).
--style allreduce: the same flat buffer all-reduced, every rank stepping AdamW on all of it (the comparison).
--model mlp|conv: an MLP, or a small conv net with BatchNorm.
"""
import argparse, statistics, time
import torch, torch.distributed as dist, torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser(); p.add_argument("--steps", type=int, default=40)
p.add_argument("--style", choices=("tensor", "list", "groups", "allreduce"), default="tensor")
p.add_argument("--model", choices=("mlp", "conv"), default="mlp")
a = p.parse_args()
dist.init_process_group("gloo"); torch.manual_seed(0); torch.set_num_threads(1)
rank, world = dist.get_rank(), dist.get_world_size()
if a.model == "conv":
    net = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
                        nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
                        nn.Flatten(), nn.Linear(64 * 8 * 8, 256), nn.ReLU(), nn.Linear(256, 10))
    x, y = torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))
else:
    net = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
    x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))


class Shard:
    """A group of parameters flattened (padded to a multiple of the world), this rank's slice of it trained."""

    def __init__(self, params: list) -> None:
        self.params = params
        numel = sum(q.numel() for q in params)
        self.size = -(-numel // world) * world
        self.flat = torch.zeros(self.size)
        self.flat[:numel] = torch.nn.utils.parameters_to_vector(params).detach()
        dist.broadcast(self.flat, 0)
        self.shard = self.flat.chunk(world)[rank].clone().requires_grad_(True)
        self.shard.grad = torch.zeros_like(self.shard)

    def scatter(self) -> None:
        grads = torch.zeros(self.size)
        torch.cat([q.grad.flatten() for q in self.params], out=grads[:sum(q.numel() for q in self.params)])
        grads /= world
        if a.style == "list":
            dist.reduce_scatter(self.shard.grad, list(grads.chunk(world)))
        elif a.style == "groups" and hasattr(dist, "reduce_scatter_single"):  # torch 2.13's names
            dist.reduce_scatter_single(self.shard.grad, grads)
        else:
            dist.reduce_scatter_tensor(self.shard.grad, grads)

    def gather(self) -> None:
        if a.style == "list":
            dist.all_gather(list(self.flat.chunk(world)), self.shard.detach())
        elif a.style == "groups" and hasattr(dist, "all_gather_single"):
            dist.all_gather_single(self.flat, self.shard.detach())
        else:
            dist.all_gather_into_tensor(self.flat, self.shard.detach())
        offset = 0
        with torch.no_grad():
            for q in self.params:
                q.copy_(self.flat[offset:offset + q.numel()].view_as(q)); offset += q.numel()


params = list(net.parameters())
if a.style == "allreduce":
    for q in params:
        dist.broadcast(q.data, 0)
    opt = torch.optim.AdamW(params, lr=1e-3)
    shards = []
else:
    groups, current, size = [], [], 0
    for q in params:
        current.append(q); size += q.numel() * 4
        if a.style == "groups" and size >= 1 << 20:
            groups.append(current); current, size = [], 0
    groups += [current] if current else []
    shards = [Shard(group) for group in groups]
    opt = torch.optim.AdamW([s.shard for s in shards], lr=1e-3)

times: list[float] = []
for step in range(a.steps):
    t = time.perf_counter()
    net.zero_grad()
    F.cross_entropy(net(x), y).backward()
    if a.style == "allreduce":
        flat = torch.cat([q.grad.flatten() for q in params])
        dist.all_reduce(flat); flat /= world
        torch.nn.utils.vector_to_parameters(flat, [q.grad for q in params])
    for s in shards:
        s.scatter()
    opt.step()
    for s in shards:
        s.gather()
    times.append(time.perf_counter() - t)
if rank == 0:
    print(f"steps: {a.steps}; median iteration time: {statistics.median(times[len(times)//2:]) * 1000:.3f} ms")
del net, opt, shards
dist.barrier(); dist.destroy_process_group()
