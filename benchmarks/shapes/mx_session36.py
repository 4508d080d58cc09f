"""Gluon on MXNet's kvstore (dist_sync) in shapes of session 36: a word-level LSTM language model (embedding, a
2-layer LSTM, a decoder; hybridized), its step split for clipping as GluonNLP's scripts do (allreduce_grads,
clip_global_norm, update; the optimizer on the workers) with Adam, and the loss read every step for logging (`asscalar()`: the worker waits for
the step there). Run with `dprorun --backend mxnet -np 2 --servers 2 python benchmarks/shapes/mx_session36.py`."""
import argparse
import statistics
import time

import mxnet as mx
from mxnet import autograd, gluon

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=40)
a = p.parse_args()
kv = mx.kv.create("dist_sync")
vocab, embed, hidden, seq, batch = 2000, 64, 128, 20, 16


class LM(gluon.HybridBlock):
    def __init__(self):
        super().__init__()
        with self.name_scope():
            self.embedding = gluon.nn.Embedding(vocab, embed)
            self.lstm = gluon.rnn.LSTM(hidden, num_layers=2, layout="NTC", input_size=embed)
            self.decoder = gluon.nn.Dense(vocab, flatten=False, in_units=hidden)

    def hybrid_forward(self, F, x):
        return self.decoder(self.lstm(self.embedding(x)))


net = LM()
net.initialize(mx.init.Xavier())
net.hybridize()
trainer = gluon.Trainer(net.collect_params(), "adam", {"learning_rate": 1e-3}, kvstore=kv, update_on_kvstore=False)
loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
x = mx.nd.random.randint(0, vocab, shape=(batch, seq)).astype("float32")
y = mx.nd.random.randint(0, vocab, shape=(batch, seq)).astype("float32")
params = [q for q in net.collect_params().values() if q.grad_req != "null"]
times = []
for step in range(a.steps):
    t = time.perf_counter()
    with autograd.record():
        loss = loss_fn(net(x), y)
    loss.backward()
    trainer.allreduce_grads()
    gluon.utils.clip_global_norm([q.grad() for q in params], 0.25 * kv.num_workers)
    trainer.update(batch * kv.num_workers)
    logged = loss.mean().asscalar()
    times.append(time.perf_counter() - t)
mx.nd.waitall()
if kv.rank == 0:
    print(f"median iteration {statistics.median(times[len(times) // 2:]) * 1000:.3f} ms", flush=True)
