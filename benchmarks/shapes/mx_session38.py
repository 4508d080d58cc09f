"""Gluon on MXNet's kvstore in shapes of session 38: --accumulate N (Gluon's gradient accumulation: every
parameter's grad_req set to "add", N forward/backward passes, then one Trainer.step and zero_grad), --deferred (a
net whose layers leave their input sizes to the first forward: the parameters exist, and the kvstore takes its keys,
only at the first step; Adam), --compressed (the Trainer given compression_params: 2-bit compressed pushes with
a threshold of 0.5, the kvstore made by the Trainer from its name). Run with
`dprorun --backend mxnet -np 2 --servers 2 python benchmarks/shapes/mx_session38.py --accumulate 2`."""
import argparse
import os
import statistics
import time

import mxnet as mx
from mxnet import autograd, gluon

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=40)
p.add_argument("--accumulate", type=int, default=1)
p.add_argument("--deferred", action="store_true"); p.add_argument("--compressed", action="store_true")
a = p.parse_args()
net = gluon.nn.HybridSequential()
for inputs, width in ((256, 512), (512, 512), (512, 256)):  # in_units=0: left to the first forward
    net.add(gluon.nn.Dense(width, activation="relu", in_units=0 if a.deferred else inputs))
net.add(gluon.nn.Dense(10, in_units=0 if a.deferred else 256))
net.initialize(mx.init.Xavier())
net.hybridize()
if a.accumulate > 1:
    for q in net.collect_params().values():
        q.grad_req = "add"
options = {"compression_params": {"type": "2bit", "threshold": 0.5}} if a.compressed else {}
if a.deferred:
    trainer = gluon.Trainer(net.collect_params(), "adam", {"learning_rate": 1e-3}, kvstore="dist_sync")
else:
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.01, "momentum": 0.9},
                            kvstore="dist_sync", **options)
loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
x, batch = mx.nd.random.normal(shape=(64, 256)), 64
y = mx.nd.random.randint(0, 10, shape=(batch,)).astype("float32")
workers = int(os.environ.get("DMLC_NUM_WORKER", "1"))  # the Trainer makes its kvstore at its first step
times = []
for step in range(a.steps):
    t = time.perf_counter()
    for _ in range(a.accumulate):
        with autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
    trainer.step(batch * a.accumulate * workers)
    if a.accumulate > 1:
        net.collect_params().zero_grad()
    loss.wait_to_read()
    times.append(time.perf_counter() - t)
mx.nd.waitall()
if trainer._kvstore.rank == 0:
    print(f"median iteration {statistics.median(times[len(times) // 2:]) * 1000:.3f} ms", flush=True)
