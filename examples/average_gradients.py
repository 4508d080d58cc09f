"""Data parallelism with no wrapper, the shape of PyTorch's "Writing Distributed Applications" tutorial: each rank
trains a small conv net on its shard of the data, and after every backward the script averages the gradients itself
with one torch.distributed.all_reduce per parameter. Launched as under torchrun (the process group from RANK,
WORLD_SIZE, MASTER_ADDR):

    dprorun -np 2 python examples/average_gradients.py --steps 40

Synthetic MNIST-shaped data (28x28, 10 classes), so that it runs anywhere. --flat all-reduces one flat buffer of all
the gradients instead (what `dpro optimize` suggests for this job on a slow network).
"""
import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.drop = nn.Dropout2d()
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.drop(self.conv2(x)), 2))
        x = F.relu(self.fc1(x.flatten(1)))
        return F.log_softmax(self.fc2(F.dropout(x, training=self.training)), dim=1)


def average_gradients(model: nn.Module, flat: bool) -> None:
    world = float(dist.get_world_size())
    if flat:
        grads = [p.grad for p in model.parameters()]
        buffer = torch.cat([g.flatten() for g in grads])
        dist.all_reduce(buffer)
        buffer /= world
        offset = 0
        for g in grads:
            g.copy_(buffer[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
        return
    for param in model.parameters():
        dist.all_reduce(param.grad.data, op=dist.ReduceOp.SUM)
        param.grad.data /= world


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--flat", action="store_true")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(1234)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.5)
    shard = torch.Generator().manual_seed(rank)  # this rank's part of the data
    images = torch.randn(512, 1, 28, 28, generator=shard)
    labels = torch.randint(0, 10, (512,), generator=shard)
    times = []
    for step in range(args.steps):
        start = time.perf_counter()
        batch = slice((step * args.batch) % 512, (step * args.batch) % 512 + args.batch)
        optimizer.zero_grad()
        loss = F.nll_loss(model(images[batch]), labels[batch])
        loss.backward()
        average_gradients(model, args.flat)
        optimizer.step()
        times.append(time.perf_counter() - start)
    if rank == 0:
        print(f"loss {loss.item():.3f}; median iteration time: {statistics.median(times[len(times) // 2:]) * 1000:.3f} "
              "ms")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
