"""Gluon on MXNet's kvstore (dist_sync) in a shape of session 51: an optimizer of the script's own (a sign-SGD with
momentum, `@mx.optimizer.register`ed), a hybridized MLP. With the optimizer on the servers (the default) the kvstore
pickles it to them, and they cannot load it: MXNet runs a server inside `import mxnet`, before the script defines
the class, so the servers run no update (they store the summed gradients as the weights) and dprorun says so;
--on-workers (the Trainer's update_on_kvstore=False) runs it on the workers, as MXNet allows. Run with `dprorun --backend mxnet -np 2 --servers 2 python
benchmarks/shapes/mx_session51.py`."""
import argparse
import os
import statistics
import time

import mxnet as mx
from mxnet import autograd, gluon

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=40)
p.add_argument("--on-workers", action="store_true")
a = p.parse_args()
workers = int(os.environ.get("DMLC_NUM_WORKER", "1"))


@mx.optimizer.register
class SignMomentum(mx.optimizer.Optimizer):
    """w -= lr * sign(momentum * m + grad), m kept per key."""

    def __init__(self, momentum=0.9, **kwargs):
        super().__init__(**kwargs)
        self.momentum = momentum

    def create_state(self, index, weight):
        return mx.nd.zeros(weight.shape, weight.context, dtype=weight.dtype)

    def update(self, index, weight, grad, state):
        self._update_count(index)
        lr = self._get_lr(index)
        grad = grad * self.rescale_grad
        state[:] = self.momentum * state + grad
        weight[:] -= lr * mx.nd.sign(state)


kv = mx.kv.create("dist_sync")
net = gluon.nn.HybridSequential()
net.add(gluon.nn.Dense(768, activation="relu", in_units=256), gluon.nn.Dense(768, activation="relu", in_units=768),
        gluon.nn.Dense(10, in_units=768))
net.initialize(mx.init.Xavier())
net.hybridize()
trainer = gluon.Trainer(net.collect_params(), "signmomentum", {"learning_rate": 1e-4}, kvstore=kv,
                        update_on_kvstore=False if a.on_workers else None)
loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
x = mx.nd.random.normal(shape=(64, 256))
y = mx.nd.random.randint(0, 10, shape=(64,)).astype("float32")
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
