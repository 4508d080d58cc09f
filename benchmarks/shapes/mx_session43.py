"""MXNet kvstore shapes of session 43. Default: a Gluon model-zoo MobileNet (multiplier 0.25, 32x32 inputs, 10
classes; depthwise convolutions and BatchNorm) trained by a Trainer on dist_sync. --pushpull: no Trainer; the script
averages the gradients itself with kv.pushpull (one call per parameter, MXNet 1.9's push-then-pull) and steps an
optimizer's updater on the workers. Run with `dprorun --backend mxnet -np 2 --servers 2 python
benchmarks/shapes/mx_session43.py`."""
import argparse
import os
import statistics
import time

import mxnet as mx
from mxnet import autograd, gluon

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=40)
p.add_argument("--pushpull", action="store_true")
a = p.parse_args()
workers = int(os.environ.get("DMLC_NUM_WORKER", "1"))
kv = mx.kv.create("dist_sync")
loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
if a.pushpull:
    net = gluon.nn.HybridSequential()
    for inputs, width in ((256, 512), (512, 512)):
        net.add(gluon.nn.Dense(width, activation="relu", in_units=inputs))
    net.add(gluon.nn.Dense(10, in_units=512))
    net.initialize(mx.init.Xavier())
    x, batch = mx.nd.random.normal(shape=(64, 256)), 64
else:
    net = gluon.model_zoo.vision.mobilenet0_25(classes=10)
    net.initialize(mx.init.Xavier())
    x, batch = mx.nd.random.normal(shape=(16, 3, 32, 32)), 16
net.hybridize()
y = mx.nd.random.randint(0, 10, shape=(batch,)).astype("float32")
params = [q for q in net.collect_params().values() if q.grad_req != "null"]
if a.pushpull:
    with autograd.record():
        loss_fn(net(x), y).backward()  # shapes known: the kvstore's keys can be made
    for key, q in enumerate(params):
        kv.init(key, q.data())
        kv.pull(key, out=q.data())
    updater = mx.optimizer.get_updater(mx.optimizer.SGD(learning_rate=0.01, momentum=0.9,
                                                        rescale_grad=1.0 / (batch * workers)))
else:
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.01, "momentum": 0.9}, kvstore=kv)
times = []
for _ in range(a.steps):
    t = time.perf_counter()
    with autograd.record():
        loss = loss_fn(net(x), y)
    loss.backward()
    if a.pushpull:
        for key, q in enumerate(params):
            kv.pushpull(key, q.grad(), out=q.grad(), priority=-key)
        for key, q in enumerate(params):
            updater(key, q.grad(), q.data())
    else:
        trainer.step(batch * workers)
    loss.wait_to_read()
    times.append(time.perf_counter() - t)
mx.nd.waitall()
if kv.rank == 0:
    print(f"median iteration {statistics.median(times[len(times) // 2:]) * 1000:.3f} ms", flush=True)
