"""MXNet on a kvstore parameter server driven by hand: no gluon.Trainer, no Module; the script pushes every
gradient and pulls every weight itself (kv.push / kv.pull per parameter, the optimizer on the servers through
kv.set_optimizer), as older MXNet training loops do. Synthetic data, an MLP of a few dense layers.

Runs under MXNet's own launch recipe and unchanged under `dprorun --backend mxnet -np 2 --servers 1`, whose hooks
then take each push/pull cycle (the first push of a key already pushed in this cycle starts the next) as an
iteration. `--compression 2bit` compresses the pushed gradients (`kv.set_gradient_compression`: MXNet 1.9.1 takes it
for separate pushes and pulls only, which is how such a loop makes them). Worker 0 prints the median iteration time
of the second half.
"""
import argparse
import statistics
import time

import mxnet as mx
from mxnet import autograd, gluon


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=32, help="per worker")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--compression", default="", help="the kvstore's gradient compression: 2bit or 1bit")
    args = parser.parse_args()

    kv = mx.kv.create("dist_sync")
    if args.compression:
        kv.set_gradient_compression({"type": args.compression, "threshold": 0.5})
    worker, workers = kv.rank, kv.num_workers
    mx.random.seed(worker)
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Flatten())
    for _ in range(args.layers):
        net.add(gluon.nn.Dense(args.width, activation="relu"))
    net.add(gluon.nn.Dense(10))
    net.initialize(mx.init.Xavier())
    net.hybridize()
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    x = mx.nd.random.normal(shape=(args.batch_size, 3, 32, 32))
    y = mx.nd.random.randint(0, 10, shape=(args.batch_size,)).astype("float32")
    with autograd.record():  # one pass so that every parameter has its shape
        loss_fn(net(x), y).backward()
    params = [p for p in net.collect_params().values() if p.grad_req != "null"]
    kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.01, momentum=0.9, rescale_grad=1.0 / (args.batch_size * workers)))
    for i, p in enumerate(params):
        kv.init(i, p.data())
        kv.pull(i, out=p.data())  # every worker starts from the servers' weights
    times = []
    for step in range(args.steps):
        started = time.perf_counter()
        with autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        for i, p in enumerate(params):  # backward order: the last layer's gradients first
            kv.push(i, p.grad(), priority=-i)
        for i, p in enumerate(params):
            kv.pull(i, out=p.data(), priority=-i)
        mx.nd.waitall()
        times.append(time.perf_counter() - started)
    if worker == 0:
        tail = times[len(times) // 2:]
        print(f"worker 0 of {workers}: median iteration {statistics.median(tail) * 1000:.2f} ms "
              f"({len(tail)} iterations, hand-written push/pull)", flush=True)


if __name__ == "__main__":
    main()
