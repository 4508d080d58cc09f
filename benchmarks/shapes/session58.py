"""Shapes not tuned for (session 58), 2 ranks: `dprorun -np 2 python session58.py --moco` (or another mode).

--fault-tolerant: torchrun's fault-tolerance tutorial shape: a snapshot (model, optimizer, step) every 10 steps,
resumed when present; rank 1 fails once at step 25 of the first attempt (TORCHELASTIC_RESTART_COUNT 0), so the job
needs a launch with --max-restarts (a conv net, Adam). SNAPSHOT names the snapshot's file (default: one per run in
the temporary folder, by TORCHELASTIC_RUN_ID).
--moco: MoCo v2's step: a query encoder under DDP, a key encoder updated as its momentum average (no gradients),
the keys' batch shuffled across ranks for BatchNorm (all_gather of the inputs, a permutation broadcast from rank 0,
each rank its shard, unshuffled after), a queue of negatives filled with all-gathered keys, InfoNCE loss.
--preemptible: a script that handles SIGTERM itself (checkpoint and leave; never sent in this job), a
DistributedSampler over a TensorDataset with set_epoch per epoch, Adamax and clip_grad_value_.
Rank 0 prints the median step time of the second half.
"""
import argparse
import os
import signal
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=40)
p.add_argument("--fault-tolerant", action="store_true")
p.add_argument("--moco", action="store_true")
p.add_argument("--preemptible", action="store_true")
a = p.parse_args()


def conv_net(width: int = 32) -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
                         nn.Conv2d(width, width, 3, padding=1, stride=2), nn.BatchNorm2d(width), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, 128))


def fault_tolerant(rank: int) -> list:
    snapshot = os.environ.get("SNAPSHOT") or os.path.join(
        tempfile.gettempdir(), f"session58-{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}.pt")
    model = conv_net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    start = 0
    if os.path.exists(snapshot):
        state = torch.load(snapshot)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["step"]
    ddp = DDP(model)
    times = []
    for step in range(start, a.steps):
        t0 = time.perf_counter()
        opt.zero_grad()
        F.cross_entropy(ddp(torch.randn(32, 3, 16, 16)), torch.randint(0, 128, (32,))).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        if rank == 0 and step % 10 == 9:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step + 1}, snapshot + ".tmp")
            os.replace(snapshot + ".tmp", snapshot)
        if rank == 1 and step == 25 and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            raise RuntimeError("simulated node failure at step 25")
    if rank == 0 and os.path.exists(snapshot):
        os.remove(snapshot)
    return times


@torch.no_grad()
def gathered(tensor: torch.Tensor) -> torch.Tensor:
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, tensor)
    return torch.cat(parts)


@torch.no_grad()
def shuffled_keys(encoder_k: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """MoCo's batch shuffle for BatchNorm: every rank's inputs gathered, shuffled by rank 0's permutation, each rank
    encodes its shard, the keys gathered and unshuffled."""
    rank, world = dist.get_rank(), dist.get_world_size()
    everything = gathered(x)
    order = torch.randperm(everything.shape[0]) if rank == 0 else torch.empty(everything.shape[0], dtype=torch.long)
    dist.broadcast(order, 0)
    keys = encoder_k(everything[order.view(world, -1)[rank]])
    return gathered(keys)[torch.argsort(order)].view(world, -1, keys.shape[1])[rank]


def moco(rank: int) -> list:
    encoder_q, encoder_k = conv_net(), conv_net()
    encoder_k.load_state_dict(encoder_q.state_dict())
    for param in encoder_k.parameters():
        param.requires_grad_(False)
    ddp = DDP(encoder_q)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.03, momentum=0.9, weight_decay=1e-4)
    queue = F.normalize(torch.randn(1024, 128), dim=1)
    pointer, times = 0, []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        images = torch.randn(32, 3, 16, 16)
        q = F.normalize(ddp(images + 0.1 * torch.randn_like(images)), dim=1)
        with torch.no_grad():
            for param_q, param_k in zip(encoder_q.parameters(), encoder_k.parameters()):
                param_k.mul_(0.999).add_(param_q.detach(), alpha=0.001)
            k = F.normalize(shuffled_keys(encoder_k, images + 0.1 * torch.randn_like(images)), dim=1)
        logits = torch.cat([(q * k).sum(1, keepdim=True), q @ queue.t()], dim=1) / 0.2
        loss = F.cross_entropy(logits, torch.zeros(logits.shape[0], dtype=torch.long))
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            keys = gathered(k)
            queue[pointer:pointer + keys.shape[0]] = keys
            pointer = (pointer + keys.shape[0]) % queue.shape[0]
        times.append(time.perf_counter() - t0)
    return times


def preemptible(rank: int) -> list:
    preempted = []
    signal.signal(signal.SIGTERM, lambda signum, frame: preempted.append(signum))
    data = torch.utils.data.TensorDataset(torch.randn(1024, 64), torch.randint(0, 10, (1024,)))
    sampler = torch.utils.data.distributed.DistributedSampler(data, shuffle=True, drop_last=True)
    loader = torch.utils.data.DataLoader(data, batch_size=32, sampler=sampler)
    model = DDP(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)))
    opt = torch.optim.Adamax(model.parameters(), lr=2e-3)
    times, step, epoch = [], 0, 0
    while step < a.steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            if preempted:  # a preempted job's checkpoint, then leave
                torch.save(model.module.state_dict(), os.path.join(tempfile.gettempdir(), f"preempted-{rank}.pt"))
                sys.exit(0)
            t0 = time.perf_counter()
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            nn.utils.clip_grad_value_(model.parameters(), 0.5)
            opt.step()
            times.append(time.perf_counter() - t0)
            step += 1
            if step >= a.steps:
                break
        epoch += 1
    return times


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(rank)
    mode = fault_tolerant if a.fault_tolerant else moco if a.moco else preemptible
    times = mode(rank)
    if rank == 0 and times:
        print(f"median step {1000 * statistics.median(times[len(times) // 2:]):.2f} ms", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
