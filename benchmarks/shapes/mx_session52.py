"""Gluon on MXNet's kvstore (dist_sync) in a shape of session 52: a hybridized MLP with dropout trained under
`autograd.record(train_mode=False)` (gradients recorded in predict mode: dropout off, as fine-tuning scripts keep
their statistics), Adam on the servers. Run with `dprorun --backend mxnet -np 2 --servers 2 python
benchmarks/shapes/mx_session52.py`."""
import argparse
import os
import statistics
import time

import mxnet as mx
from mxnet import autograd, gluon

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=40)
a = p.parse_args()
workers = int(os.environ.get("DMLC_NUM_WORKER", "1"))
kv = mx.kv.create("dist_sync")
net = gluon.nn.HybridSequential()
net.add(gluon.nn.Dense(768, activation="relu", in_units=256), gluon.nn.Dropout(0.2),
        gluon.nn.Dense(768, activation="relu", in_units=768), gluon.nn.Dense(10, in_units=768))
net.initialize(mx.init.Xavier())
net.hybridize()
trainer = gluon.Trainer(net.collect_params(), "adam", {"learning_rate": 1e-3}, kvstore=kv)
loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
x = mx.nd.random.normal(shape=(64, 256))
y = mx.nd.random.randint(0, 10, shape=(64,)).astype("float32")
times, last = [], time.perf_counter()
for step in range(a.steps):
    with autograd.record(train_mode=False):
        loss = loss_fn(net(x), y)
    loss.backward()
    trainer.step(x.shape[0] * workers)
    loss.wait_to_read()
    now = time.perf_counter()
    times.append(now - last)
    last = now
mx.nd.waitall()
if kv.rank == 0:
    print(f"median iteration {statistics.median(times[len(times) // 2:]) * 1000:.3f} ms", flush=True)
