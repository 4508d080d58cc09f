"""The shape of MXNet's Gluon distributed image-classification example: kv = mx.kv.create("dist_sync"), each
worker's shard of the data by kv.rank / kv.num_workers (a SplitSampler), a conv net with BatchNorm, hybridized,
the Trainer given that kvstore, split_and_load on the context list, an Accuracy metric, epochs.
Here: `dprorun --backend mxnet -np 2 --servers 2 python tutorial_mx_gluon.py`."""
import argparse
import statistics
import time

import mxnet as mx
from mxnet import autograd, gluon

p = argparse.ArgumentParser()
p.add_argument("--epochs", type=int, default=3)
p.add_argument("--steps-per-epoch", type=int, default=16)
p.add_argument("--batch-size", type=int, default=32)
p.add_argument("--steps", type=int, default=None,  # as benchmarks/unseen_shapes.py passes it
               help="steps in all: whole epochs of --steps-per-epoch")
a = p.parse_args()
if a.steps:
    a.epochs = max(1, a.steps // a.steps_per_epoch)
kv = mx.kv.create("dist_sync")


class SplitSampler(gluon.data.sampler.Sampler):
    """A worker's part of the dataset: the part_index-th of num_parts equal parts, shuffled each epoch."""

    def __init__(self, length, num_parts, part_index):
        self.part_len = length // num_parts
        self.start = self.part_len * part_index

    def __iter__(self):
        import random
        indices = list(range(self.start, self.start + self.part_len))
        random.shuffle(indices)
        return iter(indices)

    def __len__(self):
        return self.part_len


n = a.steps_per_epoch * a.batch_size * kv.num_workers
data = mx.nd.random.normal(shape=(n, 3, 32, 32))
label = mx.nd.random.randint(0, 10, shape=(n,)).astype("float32")
dataset = gluon.data.ArrayDataset(data, label)
loader = gluon.data.DataLoader(dataset, batch_size=a.batch_size,
                               sampler=SplitSampler(n, kv.num_workers, kv.rank), last_batch="discard")
ctx = [mx.cpu()]
net = gluon.nn.HybridSequential()
net.add(gluon.nn.Conv2D(32, 3, padding=1), gluon.nn.BatchNorm(), gluon.nn.Activation("relu"),
        gluon.nn.MaxPool2D(2), gluon.nn.Conv2D(64, 3, padding=1), gluon.nn.BatchNorm(),
        gluon.nn.Activation("relu"), gluon.nn.MaxPool2D(2), gluon.nn.Flatten(), gluon.nn.Dense(256, activation="relu"),
        gluon.nn.Dense(10))
net.initialize(mx.init.Xavier(magnitude=2), ctx=ctx)
net.hybridize()
trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.05, "momentum": 0.9, "wd": 1e-4},
                        kvstore=kv)
loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
metric = mx.metric.Accuracy()
times, walls = [], []
for epoch in range(a.epochs):
    metric.reset()
    started, steps = time.perf_counter(), 0
    for x, y in loader:
        t = time.perf_counter()
        xs = gluon.utils.split_and_load(x, ctx_list=ctx, batch_axis=0)
        ys = gluon.utils.split_and_load(y, ctx_list=ctx, batch_axis=0)
        with autograd.record():
            outputs = [net(xi) for xi in xs]
            losses = [loss_fn(o, yi) for o, yi in zip(outputs, ys)]
        for loss in losses:
            loss.backward()
        trainer.step(x.shape[0])
        metric.update(ys, outputs)
        times.append(time.perf_counter() - t)
        steps += 1
    mx.nd.waitall()
    walls.append((time.perf_counter() - started) / max(steps, 1))
    name, acc = metric.get()
    if kv.rank == 0:
        print(f"epoch {epoch}: training {name} {acc:.3f}", flush=True)
mx.nd.waitall()
if kv.rank == 0:
    print(f"median iteration {statistics.median(times[len(times) // 2:]) * 1000:.3f} ms (the loop's own timer); "
          f"epochs after the first: {statistics.median(walls[1:]) * 1000:.3f} ms a step by the wall clock", flush=True)
