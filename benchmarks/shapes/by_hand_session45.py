"""Gradients shared by the script's own torch.distributed.all_reduce calls, no wrapper (session 45); run with
`dprorun -np 2 python by_hand_session45.py --style loop`.

--style loop: the PyTorch tutorial's average_gradients (one all-reduce per parameter, then the division).
--style flat: every gradient flattened into one buffer, all-reduced once, copied back.
--style async: one all-reduce per parameter with async_op=True, then every Work waited for.
--style hooks: overlap by hand: each gradient all-reduced (async_op) from its post-accumulate hook inside the
backward, every Work waited for before the step.
--style chunks: the gradients packed into flat buffers of about 1 MB each (buckets by hand), each all-reduced.
--model mlp|conv|embed: an MLP, a small conv net with BatchNorm, or an embedding bag with a dense head.
--accumulate N: N micro-batches (forward and backward each) before the gradients are shared.
--style ddp: the same model under DistributedDataParallel (the comparison: dprorun's wrapper-based profile).
--adam: Adam instead of SGD with momentum. --log-loss: the loss all-reduced for logging after the step.
--scheduler: a StepLR made before the first step (it wraps the optimizer's step on the instance). --clip: the
gradients clipped after they are shared.
"""
import argparse, statistics, time
import torch, torch.distributed as dist, torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser(); p.add_argument("--steps", type=int, default=40)
p.add_argument("--style", choices=("loop", "flat", "async", "chunks", "hooks", "ddp"), default="loop")
p.add_argument("--model", choices=("mlp", "conv", "embed"), default="mlp")
p.add_argument("--accumulate", type=int, default=1)
p.add_argument("--adam", action="store_true"); p.add_argument("--log-loss", action="store_true")
p.add_argument("--scheduler", action="store_true"); p.add_argument("--clip", action="store_true")
a = p.parse_args()
dist.init_process_group("gloo"); torch.manual_seed(0); torch.set_num_threads(1)
world = dist.get_world_size()

if a.model == "conv":
    net = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
                        nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                        nn.Flatten(), nn.Linear(64, 10))
    x, y = torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))
elif a.model == "embed":
    class Bag(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bag = nn.EmbeddingBag(20000, 64, mode="mean")
            self.head = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return self.head(self.bag(tokens))
    net = Bag()
    x, y = torch.randint(0, 20000, (64, 20)), torch.randint(0, 10, (64,))
else:
    net = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
    x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
for prm in net.parameters():
    dist.broadcast(prm.data, 0)
model = nn.parallel.DistributedDataParallel(net) if a.style == "ddp" else net
opt = torch.optim.Adam(net.parameters(), lr=1e-3) if a.adam else \
    torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
scheduler = torch.optim.lr_scheduler.StepLR(opt, 10, 0.5) if a.scheduler else None


in_flight: list = []
if a.style == "hooks":
    for prm in net.parameters():
        prm.register_post_accumulate_grad_hook(lambda q: in_flight.append(dist.all_reduce(q.grad, async_op=True)))


def share_gradients() -> None:
    grads = [prm.grad for prm in net.parameters() if prm.grad is not None]
    if a.style == "ddp":
        return
    if a.style == "hooks":
        for work in in_flight:
            work.wait()
        in_flight.clear()
        for g in grads:
            g /= world
        return
    if a.style == "loop":
        for prm in net.parameters():
            dist.all_reduce(prm.grad.data, op=dist.ReduceOp.SUM)
            prm.grad.data /= float(world)
    elif a.style == "async":
        works = [dist.all_reduce(g, async_op=True) for g in grads]
        for work in works:
            work.wait()
        for g in grads:
            g /= world
    else:
        groups, current, size = [], [], 0
        for g in grads:
            current.append(g); size += g.numel() * g.element_size()
            if a.style == "chunks" and size >= 1 << 20:
                groups.append(current); current, size = [], 0
        groups += [current] if current else []
        for group in groups:
            flat = torch.cat([g.flatten() for g in group])
            dist.all_reduce(flat)
            flat /= world
            offset = 0
            for g in group:
                g.copy_(flat[offset:offset + g.numel()].view_as(g)); offset += g.numel()


times: list[float] = []
for step in range(a.steps):
    t = time.perf_counter()
    opt.zero_grad()
    for _ in range(a.accumulate):
        loss = F.cross_entropy(model(x), y) / a.accumulate
        loss.backward()
    share_gradients()
    if a.clip:
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
    opt.step()
    if scheduler is not None:
        scheduler.step()
    if a.log_loss:
        logged = loss.detach().clone(); dist.all_reduce(logged)
    times.append(time.perf_counter() - t)
if dist.get_rank() == 0:
    print(f"steps: {a.steps}; median iteration time: {statistics.median(times[len(times)//2:]) * 1000:.3f} ms")
dist.barrier(); dist.destroy_process_group()
