"""Gluon on MXNet's kvstore in the shapes a parameter-server job takes besides the default: the optimizer on the
workers (`update_on_kvstore=False`: the servers only sum the gradients), frozen layers (`grad_req='null'`: their keys
are never pushed; `--unfreeze-at N`: trained from step N on, as a fine-tune does; `--freeze-at N`: trained up to
step N, frozen from there), an embedding table (a large dense key), the kvstore's asynchronous mode (`--kvstore
dist_async`), and a step split for gradient clipping (`--clip`: allreduce_grads, clip_global_norm, update). Run
it with `dprorun --backend mxnet -np 2 --servers 2 python examples/mxnet_variants.py --freeze` (or launched plainly
with MXNet's DMLC_* variables). Worker 0 prints the median iteration time of the second half.
"""
import argparse
import statistics
import time

import mxnet as mx
from mxnet import autograd, gluon, nd


def build(embedding: bool) -> gluon.nn.HybridSequential:
    net = gluon.nn.HybridSequential()
    if embedding:  # 20,000 x 64 floats: a 5 MB key, split over the servers (above the big-array bound)
        net.add(gluon.nn.Embedding(20000, 64), gluon.nn.Flatten())
    net.add(gluon.nn.Dense(512, activation="relu"), gluon.nn.Dense(512, activation="relu"), gluon.nn.Dense(10))
    return net


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--kvstore", default="dist_sync")
    parser.add_argument("--update-on-kvstore", type=int, default=-1, help="1 or 0 (default: MXNet's choice)")
    parser.add_argument("--embedding", action="store_true", help="an embedding table in front of the dense layers")
    parser.add_argument("--freeze", action="store_true", help="the first dense layer frozen (grad_req='null')")
    parser.add_argument("--unfreeze-at", type=int, default=-1, help="with --freeze: that layer trained from this step")
    parser.add_argument("--freeze-at", type=int, default=-1, help="that layer trained, then frozen from this step")
    parser.add_argument("--optimizer", default="sgd")
    parser.add_argument("--clip", type=float, default=0.0,
                        help="clip the global gradient norm to this (a split step: the optimizer on the workers)")
    args = parser.parse_args()
    if args.clip > 0:
        args.update_on_kvstore = 0  # MXNet refuses allreduce_grads with the optimizer on the servers

    kv = mx.kv.create(args.kvstore)
    mx.random.seed(kv.rank)
    net = build(args.embedding)
    net.initialize(mx.init.Xavier())
    net.hybridize()
    if args.freeze:
        for name, param in net.collect_params().items():
            if "dense0" in name:
                param.grad_req = "null"
    options = {} if args.update_on_kvstore < 0 else {"update_on_kvstore": bool(args.update_on_kvstore)}
    trainer = gluon.Trainer(net.collect_params(), args.optimizer, {"learning_rate": 0.01}, kvstore=kv, **options)
    if args.embedding:
        x = nd.random.randint(0, 20000, shape=(64, 16)).astype("float32")
    else:
        x = nd.random.normal(shape=(64, 1024))
    y = nd.random.randint(0, 10, shape=(64,)).astype("float32")
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    times = []
    for step in range(args.steps):
        if step in (args.unfreeze_at, args.freeze_at):
            for name, param in net.collect_params().items():
                if "dense0" in name:
                    param.grad_req = "write" if step == args.unfreeze_at else "null"
        started = time.perf_counter()
        with autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        if args.clip > 0:
            trainer.allreduce_grads()
            grads = [p.grad() for p in net.collect_params().values() if p.grad_req != "null"]
            gluon.utils.clip_global_norm(grads, args.clip * 64)
            trainer.update(64)
        else:
            trainer.step(64)
        loss.wait_to_read()
        times.append(time.perf_counter() - started)
    nd.waitall()
    if kv.rank == 0:
        tail = times[len(times) // 2:]
        print(f"worker 0 of {kv.num_workers}: median iteration {statistics.median(tail) * 1000:.2f} ms "
              f"({len(tail)} iterations)", flush=True)


if __name__ == "__main__":
    main()
