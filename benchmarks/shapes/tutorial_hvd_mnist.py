"""The shape of Horovod's pytorch_mnist example: hvd.init, one torch thread, a DistributedSampler on hvd.size() /
hvd.rank(), the learning rate scaled by hvd.size(), broadcast_parameters and broadcast_optimizer_state, a
DistributedOptimizer over named_parameters, and a test pass each epoch whose loss and accuracy are averaged with
hvd.allreduce (metric_average). `horovodrun -np 2 python tutorial_hvd_mnist.py` (here: `dprorun --backend horovod`)."""
import argparse
import statistics
import time

import horovod.torch as hvd
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

p = argparse.ArgumentParser()
p.add_argument("--epochs", type=int, default=3)
p.add_argument("--steps-per-epoch", type=int, default=16)
p.add_argument("--batch-size", type=int, default=64)
p.add_argument("--steps", type=int, default=None,  # as benchmarks/unseen_shapes.py passes it
               help="steps in all: whole epochs of --steps-per-epoch")
a = p.parse_args()
if a.steps:
    a.epochs = max(1, a.steps // a.steps_per_epoch)
hvd.init()
torch.manual_seed(42)
torch.set_num_threads(1)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.conv2_drop = nn.Dropout2d()
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
        x = x.view(-1, 320)
        x = F.relu(self.fc1(x))
        x = F.dropout(x, training=self.training)
        return F.log_softmax(self.fc2(x), dim=1)


n = a.steps_per_epoch * a.batch_size * hvd.size()
train = TensorDataset(torch.randn(n, 1, 28, 28), torch.randint(0, 10, (n,)))
test = TensorDataset(torch.randn(512, 1, 28, 28), torch.randint(0, 10, (512,)))
train_sampler = DistributedSampler(train, num_replicas=hvd.size(), rank=hvd.rank())
train_loader = DataLoader(train, batch_size=a.batch_size, sampler=train_sampler)
test_loader = DataLoader(test, batch_size=128,
                         sampler=DistributedSampler(test, num_replicas=hvd.size(), rank=hvd.rank()))
model = Net()
optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size(), momentum=0.5)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                     compression=hvd.Compression.none, op=hvd.Average)


def metric_average(value, name):
    return hvd.allreduce(torch.tensor(value), name=name).item()


times = []
for epoch in range(a.epochs):
    model.train()
    train_sampler.set_epoch(epoch)
    for data, target in train_loader:
        t = time.perf_counter()
        optimizer.zero_grad()
        loss = F.nll_loss(model(data), target)
        loss.backward()
        optimizer.step()
        times.append(time.perf_counter() - t)
    model.eval()
    test_loss, correct = 0.0, 0.0
    with torch.no_grad():
        for data, target in test_loader:
            output = model(data)
            test_loss += F.nll_loss(output, target, reduction="sum").item()
            correct += output.argmax(1).eq(target).float().sum().item()
    test_loss = metric_average(test_loss / 256, "avg_loss")
    accuracy = metric_average(correct / 256, "avg_accuracy")
    if hvd.rank() == 0:
        print(f"epoch {epoch}: test loss {test_loss:.4f}, accuracy {accuracy:.3f}", flush=True)
if hvd.rank() == 0:
    print(f"median iteration {statistics.median(times[len(times) // 2:]) * 1000:.3f} ms", flush=True)
