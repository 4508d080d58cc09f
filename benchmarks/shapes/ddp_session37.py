"""DDP shapes of session 37. --checkpoint-every N: rank 0 saves the model's and the optimizer's state every N steps
(torch.save to a temporary file), the ranks wait for it at a barrier. --slow-input: a Dataset whose items are made
on the CPU (an augmentation of a few ms a batch) read by a DataLoader with no worker processes: the loop waits for
its input. --record-raise-at N: main() under torch.distributed.elastic's @record (the torchrun recipe for per-rank
error files), rank 1 raising at step N. --destroy: dist.destroy_process_group() at the end (with --steps 25 the job
ends inside dprorun's clean iterations). --subgroups: DDP over a process group of half the ranks (ranks 0-1 and 2-3
each train a replica of their own: run with -np 4). --clip-by-hand: the gradients' norm all-reduced by the script
(Megatron's way) and the gradients scaled by hand before Adam. --gather-metrics: every 5 steps each rank's accuracy
gathered with all_gather_object."""
import argparse, os, statistics, tempfile, time
import torch, torch.distributed as dist, torch.nn as nn
p = argparse.ArgumentParser(); p.add_argument("--steps", type=int, default=40)
p.add_argument("--checkpoint-every", type=int, default=0); p.add_argument("--slow-input", action="store_true")
p.add_argument("--clip-by-hand", action="store_true"); p.add_argument("--gather-metrics", action="store_true")
p.add_argument("--record-raise-at", type=int, default=-1); p.add_argument("--destroy", action="store_true")
p.add_argument("--subgroups", action="store_true")
a = p.parse_args()
dist.init_process_group("gloo"); torch.manual_seed(0); torch.set_num_threads(1)
rank = dist.get_rank()
group = None
if a.subgroups:
    half = dist.get_world_size() // 2
    groups = [dist.new_group(list(range(0, half))), dist.new_group(list(range(half, 2 * half)))]
    group = groups[rank // half]
model = nn.parallel.DistributedDataParallel(nn.Sequential(
    nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 512), nn.ReLU(),
    nn.Linear(512, 10)), process_group=group)
opt = torch.optim.Adam(model.parameters(), lr=1e-3)


class Augmented(torch.utils.data.Dataset):
    def __len__(self):
        return 64 * (a.steps + 2)

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(256, generator=g)
        for _ in range(12):  # an augmentation pipeline's worth of CPU work
            x = torch.tanh(x + 0.01 * torch.randn(256, generator=g)).roll(1)
        return x, i % 10


if a.slow_input:
    batches = iter(torch.utils.data.DataLoader(Augmented(), batch_size=64, num_workers=0))
else:
    fixed = (torch.randn(64, 256), torch.randint(0, 10, (64,)))
    batches = iter(lambda: fixed, None)
from torch.distributed.elastic.multiprocessing.errors import record


@record
def main():
    ckpt = os.path.join(tempfile.mkdtemp(), "ckpt.pt")
    times = []
    for step in range(a.steps):
        t = time.perf_counter()
        x, y = next(batches)
        opt.zero_grad()
        out = model(x)
        nn.functional.cross_entropy(out, y).backward()
        if a.clip_by_hand:
            sq = torch.stack([p.grad.pow(2).sum() for p in model.parameters()]).sum()
            dist.all_reduce(sq)
            scale = min(1.0, 1.0 / (float(sq.sqrt()) + 1e-6))
            for p_ in model.parameters():
                p_.grad.mul_(scale)
        opt.step()
        if a.gather_metrics and step % 5 == 0:
            accs = [None] * dist.get_world_size()
            dist.all_gather_object(accs, float((out.argmax(1) == y).float().mean()))
        if a.checkpoint_every and (step + 1) % a.checkpoint_every == 0:
            if rank == 0:
                torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step}, ckpt)
            dist.barrier()
        times.append(time.perf_counter() - t)
        if step == a.record_raise_at and rank == 1:
            raise RuntimeError(f"rank 1 failed at step {step}")
    if rank == 0:
        print(f"median iteration time: {statistics.median(times[len(times)//2:]) * 1000:.3f} ms")
    if a.destroy:
        dist.destroy_process_group()


main()
