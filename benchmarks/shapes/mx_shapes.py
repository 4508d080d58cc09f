"""Gluon on MXNet's kvstore (dist_sync) in shapes the bundled examples do not take: a DataLoader with worker
processes (`--loader-workers 2`: batches in shared memory, copied to the net's context), a deep imperative net
(`--deep`: twelve dense layers, not hybridized: pushes start as the backward makes each gradient), RMSProp with a
learning-rate scheduler (`--rmsprop`). (A float16 net does not run on MXNet's CPU build: no float16 dense layer.) Run with `dprorun --backend mxnet -np 2 --servers 2 python benchmarks/shapes/mx_shapes.py`."""
import argparse
import statistics
import time

import mxnet as mx
from mxnet import autograd, gluon

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=40)
p.add_argument("--loader-workers", type=int, default=0)
p.add_argument("--deep", action="store_true")
p.add_argument("--rmsprop", action="store_true")
a = p.parse_args()
kv = mx.kv.create("dist_sync")
net = gluon.nn.HybridSequential()
for _ in range(12 if a.deep else 3):
    net.add(gluon.nn.Dense(256 if a.deep else 512, activation="relu"))
net.add(gluon.nn.Dense(10))
net.initialize(mx.init.Xavier())
if not a.deep:
    net.hybridize()
if a.rmsprop:
    schedule = mx.lr_scheduler.FactorScheduler(step=10, factor=0.9, base_lr=1e-3)
    trainer = gluon.Trainer(net.collect_params(), "rmsprop", {"learning_rate": 1e-3, "lr_scheduler": schedule},
                            kvstore=kv)
else:
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.01, "momentum": 0.9}, kvstore=kv)
x = mx.nd.random.normal(shape=(64 * a.steps, 256))
y = mx.nd.random.randint(0, 10, shape=(64 * a.steps,)).astype("float32")
data = gluon.data.DataLoader(gluon.data.ArrayDataset(x, y), batch_size=64, num_workers=a.loader_workers)
loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
starts = []  # each iteration's start: the period includes fetching the batch
for xb, yb in data:
    starts.append(time.perf_counter())
    xb, yb = xb.as_in_context(mx.cpu()), yb.as_in_context(mx.cpu())
    with autograd.record():
        loss = loss_fn(net(xb), yb)
    loss.backward()
    trainer.step(64 * kv.num_workers)
    loss.wait_to_read()
mx.nd.waitall()
times = [b - a for a, b in zip(starts, starts[1:])]
if kv.rank == 0:
    print(f"median iteration {statistics.median(times[len(times) // 2:]) * 1000:.3f} ms", flush=True)
