"""Gluon on MXNet's kvstore (dist_sync) in shapes of session 50. Default (--tied): a word-level language model whose
decoder shares the embedding's weight (`Dense(..., params=embedding.params)`, as GluonNLP's tied models: one key
used twice in the forward, its gradient the sum of both uses), hybridized, Adam on the servers. --ragged: an MLP over
a dataset of 1,000 samples in batches of 96, so every epoch (11 steps) ends on a batch of 40, each step's Trainer told
its own batch size: with the optimizer on the workers (`update_on_kvstore=False`), since MXNet's Trainer raises on a
batch size that changes while the servers update. Run with `dprorun --backend mxnet -np 2 --servers 2 python benchmarks/shapes/mx_session50.py`."""
import argparse
import os
import statistics
import time

import mxnet as mx
from mxnet import autograd, gluon

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=40)
p.add_argument("--ragged", action="store_true")
a = p.parse_args()
workers = int(os.environ.get("DMLC_NUM_WORKER", "1"))
kv = mx.kv.create("dist_sync")


class TiedLM(gluon.HybridBlock):
    def __init__(self, vocab: int = 8000, hidden: int = 128, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.embedding = gluon.nn.Embedding(vocab, hidden)
            self.mix = gluon.nn.Dense(hidden, activation="tanh", flatten=False, in_units=hidden)
            self.decoder = gluon.nn.Dense(vocab, flatten=False, in_units=hidden, params=self.embedding.params)

    def hybrid_forward(self, F, tokens):
        return self.decoder(self.mix(self.embedding(tokens)))


if a.ragged:
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(512, activation="relu", in_units=256), gluon.nn.Dense(10, in_units=512))
    data = mx.nd.random.normal(shape=(1000, 256))
    labels = mx.nd.random.randint(0, 10, shape=(1000,)).astype("float32")
    loader = gluon.data.DataLoader(gluon.data.ArrayDataset(data, labels), batch_size=96, last_batch="keep")
    optimizer = ("sgd", {"learning_rate": 0.01, "momentum": 0.9})
else:
    net = TiedLM()
    optimizer = ("adam", {"learning_rate": 0.001})
net.initialize(mx.init.Xavier())
net.hybridize()
trainer = gluon.Trainer(net.collect_params(), *optimizer, kvstore=kv, update_on_kvstore=False if a.ragged else None)
loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
tokens = mx.nd.random.randint(0, 8000, shape=(16, 20)).astype("float32")
targets = mx.nd.random.randint(0, 8000, shape=(16, 20)).astype("float32")


def batches():
    while True:
        if a.ragged:
            yield from loader
        else:
            yield tokens, targets


times, last = [], time.perf_counter()
for step, (x, y) in zip(range(a.steps), batches()):  # an iteration from one batch's fetch to the next's
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
