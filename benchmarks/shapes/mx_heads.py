"""Gluon on MXNet's kvstore (dist_sync) with two heads taken in turns, a step each (multi-task training): the head a
step does not use keeps a stale gradient (`Trainer.step(..., ignore_stale_grad=True)`); every key is still pushed
and pulled each step. Run with `dprorun --backend mxnet -np 2 --servers 2 python benchmarks/shapes/mx_heads.py`."""
import argparse
import statistics
import time

import mxnet as mx
from mxnet import autograd, gluon

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=40)
a = p.parse_args()
kv = mx.kv.create("dist_sync")
trunk = gluon.nn.HybridSequential()
trunk.add(gluon.nn.Dense(512, activation="relu", in_units=256), gluon.nn.Dense(512, activation="relu", in_units=512))
heads = [gluon.nn.Dense(10, in_units=512), gluon.nn.Dense(1000, in_units=512)]
params = gluon.ParameterDict()
for block in (trunk, *heads):
    block.initialize(mx.init.Xavier())
    params.update(block.collect_params())
trainer = gluon.Trainer(params, "sgd", {"learning_rate": 0.01}, kvstore=kv)
x = mx.nd.random.normal(shape=(64, 256))
y = mx.nd.random.randint(0, 10, shape=(64,)).astype("float32")
loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
times = []
for step in range(a.steps):
    started = time.perf_counter()
    with autograd.record():
        loss = loss_fn(heads[step % 2](trunk(x)), y)
    loss.backward()
    trainer.step(64 * kv.num_workers, ignore_stale_grad=True)
    loss.wait_to_read()
    times.append(time.perf_counter() - started)
mx.nd.waitall()
if kv.rank == 0:
    print(f"worker 0: median iteration {1000 * statistics.median(times[len(times) // 2:]):.2f} ms")
