"""Gluon on MXNet's kvstore in a shape of session 39: an MLP hybridized with static_alloc and static_shape, NAG with
multi_precision and a FactorScheduler on the servers (the Trainer's optimizer sent to them). Run with
`dprorun --backend mxnet -np 2 --servers 2 python benchmarks/shapes/mx_session39.py`. --kvstore local: the same on a
local kvstore, where each worker trains on its own (dprorun says why there is no replay)."""
import argparse
import os
import statistics
import time

import mxnet as mx
from mxnet import autograd, gluon

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=40)
p.add_argument("--kvstore", default="dist_sync")
a = p.parse_args()
workers = int(os.environ.get("DMLC_NUM_WORKER", "1"))
kv = mx.kv.create(a.kvstore)
net = gluon.nn.HybridSequential()
for inputs, width in ((256, 512), (512, 512), (512, 256)):
    net.add(gluon.nn.Dense(width, activation="relu", in_units=inputs))
net.add(gluon.nn.Dense(10, in_units=256))
net.initialize(mx.init.Xavier())
net.hybridize(static_alloc=True, static_shape=True)
schedule = mx.lr_scheduler.FactorScheduler(step=10, factor=0.9, base_lr=0.01)
trainer = gluon.Trainer(net.collect_params(), "nag", {"learning_rate": 0.01, "momentum": 0.9, "multi_precision": True,
                                                      "lr_scheduler": schedule}, kvstore=kv)
loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
x, batch = mx.nd.random.normal(shape=(64, 256)), 64
y = mx.nd.random.randint(0, 10, shape=(batch,)).astype("float32")
times = []
for step in range(a.steps):
    t = time.perf_counter()
    with autograd.record():
        loss = loss_fn(net(x), y)
    loss.backward()
    trainer.step(batch * workers)
    loss.wait_to_read()
    times.append(time.perf_counter() - t)
mx.nd.waitall()
if kv.rank == 0:
    print(f"median iteration {statistics.median(times[len(times) // 2:]) * 1000:.3f} ms", flush=True)
