"""Gluon on MXNet's kvstore written as many training scripts are, not as the other examples: a conv net with
BatchNorm (running statistics that are never pushed), gradients accumulated over `--accumulate` batches
(`grad_req='add'`, one Trainer.step per group), the kvstore named by a string and made by the Trainer, an NAG
optimizer; `--clip` splits the step for gradient clipping (allreduce_grads, clip_global_norm, update: the optimizer
on the workers); `--model lstm` swaps the conv net for a 2-layer LSTM language model; `--contexts N` splits each batch
over N contexts (`split_and_load`, as a multi-GPU worker does; CPU contexts here). The script ends without
mx.nd.waitall(). Run it with `dprorun --backend mxnet -np 2 --servers 2 python examples/mxnet_batchnorm_clip.py`
(or launched plainly with MXNet's DMLC_* variables). Each worker prints its median iteration time of the second half.
"""
import argparse
import os
import statistics
import time

import mxnet as mx
from mxnet import autograd, gluon, nd


class LanguageModel(gluon.Block):
    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        self.embed = gluon.nn.Embedding(vocab, hidden)
        self.lstm = gluon.rnn.LSTM(hidden, num_layers=2, layout="NTC")
        self.out = gluon.nn.Dense(vocab, flatten=False)

    def forward(self, tokens):
        return self.out(self.lstm(self.embed(tokens)))


def build(model: str):
    if model == "lstm":
        return LanguageModel(2000, 128)
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Conv2D(32, 3, padding=1), gluon.nn.BatchNorm(), gluon.nn.Activation("relu"),
            gluon.nn.MaxPool2D(2), gluon.nn.Conv2D(64, 3, padding=1), gluon.nn.BatchNorm(),
            gluon.nn.Activation("relu"), gluon.nn.GlobalAvgPool2D(), gluon.nn.Dense(10))
    net.hybridize()
    return net


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps")
    parser.add_argument("--model", choices=("conv", "lstm"), default="conv")
    parser.add_argument("--accumulate", type=int, default=2, help="batches per optimizer step")
    parser.add_argument("--clip", type=float, default=0.0, help="clip the global gradient norm to this (0: no)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--contexts", type=int, default=1, help="contexts a batch is split over (mx.cpu(i))")
    args = parser.parse_args()

    contexts = [mx.cpu(i) for i in range(args.contexts)]
    net = build(args.model)
    net.initialize(mx.init.Xavier(), ctx=contexts)
    params = net.collect_params()
    if args.accumulate > 1:
        for param in params.values():
            if param.grad_req != "null":
                param.grad_req = "add"
    options = {"update_on_kvstore": False} if args.clip > 0 else {}
    trainer = gluon.Trainer(params, "nag", {"learning_rate": 0.01, "momentum": 0.9}, kvstore="dist_sync", **options)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    if args.model == "lstm":
        x = nd.random.randint(0, 2000, shape=(args.batch_size, 20)).astype("float32")
        y = nd.random.randint(0, 2000, shape=(args.batch_size, 20)).astype("float32")
    else:
        x = nd.random.normal(shape=(args.batch_size, 3, 32, 32))
        y = nd.random.randint(0, 10, shape=(args.batch_size,)).astype("float32")
    samples = args.batch_size * args.accumulate
    times = []
    for _ in range(args.steps):
        started = time.perf_counter()
        for _ in range(args.accumulate):
            with autograd.record():
                losses = [loss_fn(net(xs), ys) for xs, ys in zip(gluon.utils.split_and_load(x, contexts),
                                                                 gluon.utils.split_and_load(y, contexts))]
            autograd.backward(losses)
        if args.clip > 0:
            trainer.allreduce_grads()
            grads = [p.grad() for p in params.values() if p.grad_req != "null"]
            gluon.utils.clip_global_norm(grads, args.clip * samples)
            trainer.update(samples)
        else:
            trainer.step(samples)
        if args.accumulate > 1:
            params.zero_grad()
        losses[-1].wait_to_read()
        times.append(time.perf_counter() - started)
    tail = times[len(times) // 2:]
    print(f"worker {os.environ.get('DPRO_MX_INDEX', os.getpid())}: median iteration "
          f"{statistics.median(tail) * 1000:.2f} ms ({len(tail)} iterations)", flush=True)


if __name__ == "__main__":
    main()
