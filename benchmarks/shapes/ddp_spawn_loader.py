"""DDP with DataLoader workers started by "spawn" or "forkserver" (session 40): each worker is a fresh interpreter
that imports this script as __mp_main__ (so the script keeps its training under `if __name__ == "__main__"`), and
Python 3.14 makes forkserver the default on Linux. The workers must run as under torchrun: no hooks recording in
them, no files of theirs taken for a rank's. `dprorun -np 2 python ddp_spawn_loader.py [--context forkserver]`."""
import argparse, statistics, time

import torch, torch.distributed as dist, torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, DistributedSampler


class Shapes(Dataset):
    """A synthetic dataset with a little work per item (a loader that earns its workers)."""

    def __len__(self):
        return 4096

    def __getitem__(self, index):
        g = torch.Generator().manual_seed(index)
        x = torch.randn(256, generator=g)
        return torch.tanh(x) * 2, int(index % 10)


def main():
    p = argparse.ArgumentParser(); p.add_argument("--steps", type=int, default=40)
    p.add_argument("--context", default="spawn", choices=("spawn", "forkserver"))
    p.add_argument("--workers", type=int, default=2)
    a = p.parse_args()
    dist.init_process_group("gloo"); torch.manual_seed(0); torch.set_num_threads(1)
    data = Shapes()
    loader = DataLoader(data, batch_size=64, sampler=DistributedSampler(data), num_workers=a.workers,
                        multiprocessing_context=a.context, persistent_workers=True, prefetch_factor=4)
    model = nn.parallel.DistributedDataParallel(
        nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    times, step, epoch = [], 0, 0
    while step < a.steps:
        loader.sampler.set_epoch(epoch)
        for x, y in loader:
            t = time.perf_counter()
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            times.append(time.perf_counter() - t)
            step += 1
            if step == a.steps:
                break
        epoch += 1
    if dist.get_rank() == 0:
        print(f"median iteration time: {statistics.median(times[len(times)//2:]) * 1000:.3f} ms")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
