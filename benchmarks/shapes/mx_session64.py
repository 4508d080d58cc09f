"""Gluon on MXNet's kvstore (dist_sync) in shapes of session 64: --amp-bf16 (mxnet.contrib.amp with bfloat16 on the
CPU: the conv net's compute cast by AMP, float32 weights and gradients pushed; a float16 net with multi_precision
SGD cannot run on the CPU: "FP16 gemm on cpu not implemented"). Run with
`dprorun --backend mxnet -np 2 --servers 2 python benchmarks/shapes/mx_session64.py --amp-bf16`."""
import argparse
import os
import statistics
import time

import mxnet as mx
from mxnet import autograd, gluon

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=40)
p.add_argument("--amp-bf16", action="store_true")
a = p.parse_args()
workers = int(os.environ.get("DMLC_NUM_WORKER", "1"))
if a.amp_bf16:
    from mxnet.contrib import amp
    amp.init(target_dtype="bfloat16")
kv = mx.kv.create("dist_sync")
net = gluon.nn.HybridSequential()
net.add(gluon.nn.Conv2D(32, 3, padding=1, activation="relu"), gluon.nn.MaxPool2D(),
        gluon.nn.Conv2D(64, 3, padding=1, activation="relu"), gluon.nn.GlobalAvgPool2D(),
        gluon.nn.Dense(256, activation="relu"), gluon.nn.Dense(10))
net.initialize(mx.init.Xavier())
x = mx.nd.random.uniform(shape=(32, 3, 32, 32))
y = mx.nd.random.randint(0, 10, shape=(32,)).astype("float32")
net.hybridize()
trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.01, "momentum": 0.9}, kvstore=kv)
loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
times, last = [], time.perf_counter()
for step in range(a.steps):
    with autograd.record():
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
