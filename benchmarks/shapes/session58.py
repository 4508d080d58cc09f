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
--gnn: a message-passing graph network on batches of random graphs of varying size (index_add_ scatter of edge
messages, a per-graph mean readout through index_add_), so each step's work differs; AdamW.
--ctc: a speech model's step: a strided Conv1d front-end, a bidirectional GRU, CTC loss over utterances and
transcripts of varying lengths (zero_infinity), RMSprop with gradient-norm clipping.
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
p.add_argument("--gnn", action="store_true")
p.add_argument("--ctc", action="store_true")
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


class MessagePassing(nn.Module):
    def __init__(self, width: int = 64, layers: int = 3, classes: int = 8):
        super().__init__()
        self.embed = nn.Linear(16, width)
        self.message = nn.ModuleList(nn.Linear(2 * width, width) for _ in range(layers))
        self.update = nn.ModuleList(nn.GRUCell(width, width) for _ in range(layers))
        self.readout = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, classes))

    def forward(self, x, edges, graph_of_node, graphs):
        h = self.embed(x)
        for message, update in zip(self.message, self.update):
            m = F.relu(message(torch.cat([h[edges[0]], h[edges[1]]], dim=1)))
            inbox = torch.zeros_like(h).index_add_(0, edges[1], m)
            h = update(inbox, h)
        pooled = torch.zeros(graphs, h.shape[1]).index_add_(0, graph_of_node, h)
        counts = torch.zeros(graphs).index_add_(0, graph_of_node, torch.ones(h.shape[0])).clamp(min=1)
        return self.readout(pooled / counts[:, None])


def random_graphs(graphs: int = 8):
    sizes = torch.randint(8, 48, (graphs,))
    offsets = torch.cumsum(sizes, 0) - sizes
    edges, owner = [], []
    for g, (size, offset) in enumerate(zip(sizes.tolist(), offsets.tolist())):
        count = 3 * size
        edges.append(torch.randint(0, size, (2, count)) + offset)
        owner.append(torch.full((size,), g))
    return torch.randn(int(sizes.sum()), 16), torch.cat(edges, 1), torch.cat(owner), graphs


def gnn(rank: int) -> list:
    model = DDP(MessagePassing())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    times = []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        x, edges, owner, graphs = random_graphs()
        opt.zero_grad()
        F.cross_entropy(model(x, edges, owner, graphs), torch.randint(0, 8, (graphs,))).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    return times


class Speech(nn.Module):
    def __init__(self, features: int = 40, width: int = 64, tokens: int = 29):
        super().__init__()
        self.front = nn.Sequential(nn.Conv1d(features, width, 5, stride=2, padding=2), nn.ReLU(),
                                   nn.Conv1d(width, width, 5, stride=2, padding=2), nn.ReLU())
        self.rnn = nn.GRU(width, width, batch_first=True, bidirectional=True)
        self.out = nn.Linear(2 * width, tokens)

    def forward(self, frames):
        h = self.front(frames.transpose(1, 2)).transpose(1, 2)
        return self.out(self.rnn(h)[0]).log_softmax(-1)


def ctc(rank: int) -> list:
    model = DDP(Speech())
    opt = torch.optim.RMSprop(model.parameters(), lr=5e-4)
    loss_fn = nn.CTCLoss(blank=0, zero_infinity=True)
    times = []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        frames = int(torch.randint(60, 120, ()).item())  # utterances of this batch, padded to its longest
        lengths = torch.randint(frames // 2, frames + 1, (8,))
        log_probs = model(torch.randn(8, frames, 40))
        out_lengths = ((lengths + 3) // 4).clamp(max=log_probs.shape[1])
        targets = torch.randint(1, 29, (8, 15))
        target_lengths = torch.randint(5, 16, (8,)).minimum(out_lengths)
        loss = loss_fn(log_probs.transpose(0, 1), targets, out_lengths, target_lengths)
        opt.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 5.0)
        opt.step()
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(rank)
    mode = (fault_tolerant if a.fault_tolerant else moco if a.moco else gnn if a.gnn else ctc if a.ctc
            else preemptible)
    times = mode(rank)
    if rank == 0 and times:
        print(f"median step {1000 * statistics.median(times[len(times) // 2:]):.2f} ms", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
