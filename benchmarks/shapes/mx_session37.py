"""Gluon on MXNet's kvstore in shapes of session 37: --zoo (a model-zoo ResNet-18 on 32x32 images, hybridized with
static_alloc and static_shape, BatchNorm's running statistics among its parameters but never pushed; SGD with
momentum), --device-kv (the `dist_sync_device` kvstore, which merges on the workers' devices before pushing),
--save-every N (worker 0 saves the net's parameters every N steps, the others go on; MXNet refuses to save the
Trainer's states with the optimizer on the servers), --module-eval (the Module API's fit over 4 epochs with
eval_data: a validation pass over 4 batches at every epoch's end, Module.score's forward passes), --batched (no
Trainer: every gradient pushed and pulled by one kv.pushpull call over the list of keys, then SGD by hand on the
workers). Run
with `dprorun --backend mxnet -np 2 --servers 2 python benchmarks/shapes/mx_session37.py --zoo`."""
import argparse
import os
import statistics
import tempfile
import time

import mxnet as mx
from mxnet import autograd, gluon

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=40)
p.add_argument("--zoo", action="store_true")
p.add_argument("--device-kv", action="store_true")
p.add_argument("--save-every", type=int, default=0)
p.add_argument("--module-eval", action="store_true"); p.add_argument("--batched", action="store_true")
a = p.parse_args()
kv = mx.kv.create("dist_sync_device" if a.device_kv else "dist_sync")
if a.module_eval:
    sym = mx.sym.flatten(mx.sym.Variable("data"))
    for k, width in enumerate((512, 512, 256)):
        sym = mx.sym.Activation(mx.sym.FullyConnected(sym, num_hidden=width, name=f"fc{k}"), act_type="relu")
    sym = mx.sym.SoftmaxOutput(mx.sym.FullyConnected(sym, num_hidden=10, name="head"), name="softmax")
    per_epoch, batch = a.steps // 4, 64

    def batches(n):
        return mx.io.NDArrayIter(mx.nd.random.normal(shape=(n * batch, 256)),
                                 mx.nd.random.randint(0, 10, shape=(n * batch,)).astype("float32"),
                                 batch_size=batch, label_name="softmax_label")

    stamps = []

    def batch_end(_):
        mx.nd.waitall()
        stamps.append(time.perf_counter())

    mod = mx.mod.Module(sym, context=mx.cpu())
    mod.fit(batches(per_epoch), eval_data=batches(4), eval_metric="acc", num_epoch=4, kvstore=kv, optimizer="sgd",
            optimizer_params={"learning_rate": 0.01, "momentum": 0.9}, initializer=mx.init.Xavier(),
            batch_end_callback=batch_end)
    gaps = sorted(b - a_ for a_, b in zip(stamps, stamps[1:]) if b - a_ > 0)
    if kv.rank == 0:  # the median of the gaps between batch ends (an epoch's first holds the validation)
        print(f"median iteration {statistics.median(gaps) * 1000:.3f} ms", flush=True)
    mx.nd.waitall()
    raise SystemExit(0)
if a.zoo:
    net = gluon.model_zoo.vision.resnet18_v1(classes=10, thumbnail=True)
    x, batch = mx.nd.random.normal(shape=(8, 3, 32, 32)), 8
else:
    net = gluon.nn.HybridSequential()
    for width in (512, 512, 256):
        net.add(gluon.nn.Dense(width, activation="relu"))
    net.add(gluon.nn.Dense(10))
    x, batch = mx.nd.random.normal(shape=(64, 256)), 64
net.initialize(mx.init.Xavier())
net.hybridize(static_alloc=True, static_shape=True)
params = [q for q in net.collect_params().values() if q.grad_req != "null"]
if a.batched:
    net(x)  # the shapes are known once the net has run
    for k, q in enumerate(params):
        kv.init(k, q.data())
        kv.pull(k, out=q.data())
else:
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.01, "momentum": 0.9, "wd": 1e-4},
                            kvstore=kv)
loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
y = mx.nd.random.randint(0, 10, shape=(batch,)).astype("float32")
where = tempfile.mkdtemp()
times = []
for step in range(a.steps):
    t = time.perf_counter()
    with autograd.record():
        loss = loss_fn(net(x), y)
    loss.backward()
    if a.batched:
        grads = [q.grad() for q in params]
        kv.pushpull(list(range(len(params))), grads, out=grads)
        for q, g in zip(params, grads):
            mx.nd.sgd_update(q.data(), g, lr=0.01, wd=1e-4, rescale_grad=1.0 / (batch * kv.num_workers), out=q.data())
    else:
        trainer.step(batch * kv.num_workers)
    if a.save_every and (step + 1) % a.save_every == 0 and kv.rank == 0:
        net.save_parameters(os.path.join(where, "net.params"))
    loss.wait_to_read()
    times.append(time.perf_counter() - t)
mx.nd.waitall()
if kv.rank == 0:
    print(f"median iteration {statistics.median(times[len(times) // 2:]) * 1000:.3f} ms", flush=True)
