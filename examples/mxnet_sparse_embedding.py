"""MXNet on a kvstore parameter server with a row-sparse embedding table, driven by hand as MXNet's sparse examples
are: the table's gradient is row-sparse (`Embedding(sparse_grad=True)`: only the rows the batch looked up), pushed
as such, and each worker pulls back only the rows its next batch needs (`kv.row_sparse_pull`), the dense layers
pushed and pulled whole; the optimizer (SGD) on the servers. Synthetic token batches.

MXNet places the table by its full size (past MXNET_KVSTORE_BIGARRAY_BOUND elements: its rows split over every
server) and sends only the rows. Runs under MXNet's own launch recipe and unchanged under `dprorun --backend mxnet
-np 2 --servers 2` (each push/pull cycle an iteration). Worker 0 prints the median iteration time of the second half.
"""
import argparse
import statistics
import time

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon


class TokenModel(gluon.nn.Block):
    def __init__(self, rows: int, dim: int, width: int):
        super().__init__()
        self.table = gluon.nn.Embedding(rows, dim, sparse_grad=True)
        self.body = gluon.nn.Sequential()
        self.body.add(gluon.nn.Dense(width, activation="relu"), gluon.nn.Dense(10))

    def forward(self, tokens):
        return self.body(self.table(tokens).mean(axis=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=64, help="per worker")
    parser.add_argument("--tokens", type=int, default=16, help="tokens per sample")
    parser.add_argument("--rows", type=int, default=100000, help="the table's rows (vocabulary)")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--kvstore", default="dist_sync", help="dist_sync, or dist_async (each push updated alone)")
    args = parser.parse_args()

    kv = mx.kv.create(args.kvstore)
    worker, workers = kv.rank, kv.num_workers
    mx.random.seed(worker)
    rng = np.random.RandomState(worker)
    net = TokenModel(args.rows, args.dim, args.width)
    net.initialize(mx.init.Uniform(0.1))
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()

    def batch():
        # a Zipf-like draw: frequent tokens in most batches, the tail now and then; with the rows it looks up
        tokens = np.minimum(rng.zipf(1.2, size=(args.batch_size, args.tokens)), args.rows) - 1
        return (mx.nd.array(tokens), mx.nd.array(rng.randint(0, 10, size=args.batch_size)),
                mx.nd.array(np.unique(tokens)))

    batches = [batch() for _ in range(8)]  # drawn beforehand: the loop times the training, not numpy
    x, y, _ = batches[0]
    with autograd.record():  # one pass so that every parameter has its shape
        loss_fn(net(x), y).backward()
    params = list(net.collect_params().values())
    kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.05, rescale_grad=1.0 / (args.batch_size * workers)))
    for i, p in enumerate(params):
        kv.init(i, p.data().tostype("row_sparse") if i == 0 else p.data())
    table = params[0].data()
    pulled = mx.nd.sparse.zeros("row_sparse", table.shape)
    times = []
    for step in range(args.steps):
        started = time.perf_counter()
        with autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        for i, p in reversed(list(enumerate(params))):  # backward order: the last layer's gradients first
            kv.push(i, p.grad(), priority=-i)
        x, y, rows = batches[(step + 1) % len(batches)]  # the next batch: the table's rows it looks up are pulled
        kv.row_sparse_pull(0, out=pulled, row_ids=rows, priority=0)
        for i, p in enumerate(params[1:], start=1):
            kv.pull(i, out=p.data(), priority=-i)
        table[pulled.indices] = pulled.data
        mx.nd.waitall()
        times.append(time.perf_counter() - started)
    if worker == 0:
        tail = times[len(times) // 2:]
        print(f"worker 0 of {workers}: median iteration {statistics.median(tail) * 1000:.2f} ms "
              f"({len(tail)} iterations, row-sparse table pushed and pulled by rows)", flush=True)


if __name__ == "__main__":
    main()
