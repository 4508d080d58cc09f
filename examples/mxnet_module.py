"""MXNet's Module API on a kvstore parameter server (dist_sync): a symbolic MLP trained by `Module.fit`,
synthetic data.

The other MXNet idiom next to Gluon (examples/mxnet_gluon.py): a Symbol graph, an NDArrayIter, `mod.fit(...,
kvstore=...)`, string keys (the parameters' names) in the kvstore, the optimizer on the servers. Runs the same
under MXNet's own launch recipe and unchanged under `dprorun --backend mxnet -np 2 --servers 2`. Worker 0
prints the median iteration time of the second half (a batch-end callback).
"""
import argparse
import statistics
import time

import mxnet as mx


def build(width: int, layers: int) -> mx.sym.Symbol:
    net = mx.sym.flatten(mx.sym.Variable("data"))
    for k in range(layers):
        net = mx.sym.Activation(mx.sym.FullyConnected(net, num_hidden=width, name=f"fc{k}"), act_type="relu")
    net = mx.sym.FullyConnected(net, num_hidden=10, name="head")
    return mx.sym.SoftmaxOutput(net, name="softmax")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=32, help="per worker")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--optimizer", default="sgd", help="sgd (momentum 0.9), adam, ...")
    parser.add_argument("--kvstore", default="dist_sync")
    args = parser.parse_args()

    kv = mx.kv.create(args.kvstore)
    worker = kv.rank
    mx.random.seed(worker)
    data = mx.nd.random.normal(shape=(args.steps * args.batch_size, 3, 32, 32))
    label = mx.nd.random.randint(0, 10, shape=(args.steps * args.batch_size,)).astype("float32")
    batches = mx.io.NDArrayIter(data, label, batch_size=args.batch_size, label_name="softmax_label")
    params = {"learning_rate": 0.01}
    if args.optimizer == "sgd":
        params["momentum"] = 0.9
    stamps = []

    def batch_end(_):
        mx.nd.waitall()
        stamps.append(time.perf_counter())

    mod = mx.mod.Module(build(args.width, args.layers), context=mx.cpu())
    mod.fit(batches, num_epoch=1, kvstore=kv, optimizer=args.optimizer, optimizer_params=params,
            initializer=mx.init.Xavier(), batch_end_callback=batch_end)
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    if worker == 0 and gaps:
        half = gaps[len(gaps) // 2:]
        print(f"worker 0 of {kv.num_workers}: median iteration {1000 * statistics.median(half):.2f} ms "
              f"({len(gaps) + 1} iterations, Module API)", flush=True)


if __name__ == "__main__":
    main()
