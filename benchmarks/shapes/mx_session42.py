"""Gluon on MXNet's kvstore in a shape of session 42: the training loop runs in a thread of the script's, the main
thread waiting on it (as a scheduler's wrapper does). Run with `dprorun --backend mxnet -np 2 --servers 2 python
benchmarks/shapes/mx_session42.py`."""
import argparse
import os
import statistics
import threading
import time

import mxnet as mx
from mxnet import autograd, gluon

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=40)
a = p.parse_args()
workers = int(os.environ.get("DMLC_NUM_WORKER", "1"))
kv = mx.kv.create("dist_sync")
net = gluon.nn.HybridSequential()
for inputs, width in ((256, 512), (512, 512)):
    net.add(gluon.nn.Dense(width, activation="relu", in_units=inputs))
net.add(gluon.nn.Dense(10, in_units=512))
net.initialize(mx.init.Xavier())
trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.01, "momentum": 0.9}, kvstore=kv)
loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
x, batch = mx.nd.random.normal(shape=(64, 256)), 64
y = mx.nd.random.randint(0, 10, shape=(batch,)).astype("float32")
times = []


def train() -> None:
    for _ in range(a.steps):
        t = time.perf_counter()
        with autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        trainer.step(batch * workers)
        loss.wait_to_read()
        times.append(time.perf_counter() - t)


worker = threading.Thread(target=train, name="trainer")
worker.start()
worker.join()
mx.nd.waitall()
if kv.rank == 0:
    print(f"median iteration {statistics.median(times[len(times) // 2:]) * 1000:.3f} ms", flush=True)
