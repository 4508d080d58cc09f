"""MXNet Gluon on a kvstore parameter server (dist_sync): a small conv trunk and an MLP head, synthetic data.

An ordinary MXNet PS script: the scheduler and the servers run it too (MXNet turns a process whose DMLC_ROLE is
server or scheduler into that role at `import mxnet` and exits there), the workers train. It runs the same under
MXNet's own launch recipe (DMLC_* variables per role) and unchanged under `dprorun --backend mxnet -np 2
--servers 2`. Worker 0 prints the median iteration time of the second half.
"""
import argparse
import os
import statistics
import time

import mxnet as mx
from mxnet import autograd, gluon


def build(model: str, width: int) -> gluon.nn.HybridSequential:
    net = gluon.nn.HybridSequential()
    if model == "conv":
        net.add(gluon.nn.Conv2D(16, 3, activation="relu"), gluon.nn.Conv2D(16, 3, activation="relu"),
                gluon.nn.MaxPool2D(2), gluon.nn.Flatten(), gluon.nn.Dense(width, activation="relu"),
                gluon.nn.Dense(10))
    else:  # "mlp": several dense layers of one width
        net.add(gluon.nn.Flatten())
        for _ in range(4):
            net.add(gluon.nn.Dense(width, activation="relu"))
        net.add(gluon.nn.Dense(10))
    return net


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=32, help="per worker")
    parser.add_argument("--model", choices=("conv", "mlp"), default="conv")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--optimizer", default="sgd", help="sgd (momentum 0.9), adam, ...")
    parser.add_argument("--kvstore", default="dist_sync")
    parser.add_argument("--no-hybridize", action="store_true",
                        help="run the net imperatively (op by op: pushes start as each gradient is ready)")
    parser.add_argument("--loader-workers", type=int, default=0,
                        help="batches from a gluon DataLoader with this many worker processes, a new loader every 8 "
                             "steps (as a loader per epoch: each one's pool is terminated when it is dropped)")
    parser.add_argument("--contexts", type=int, default=1,
                        help="contexts a batch is split over (mx.cpu(i); as a worker with several GPUs does)")
    parser.add_argument("--own-profiler", default="",
                        help="FIRST,LAST: the script profiles those steps itself (mx.profiler set_config, run, stop "
                             "and dump, as a user's script does), into a temporary file")
    parser.add_argument("--validate-every", type=int, default=0,
                        help="every this many steps, a validation pass (forward only, outside autograd.record) over "
                             "4 batches, after the step and outside the iteration the script times")
    parser.add_argument("--fail-at-step", type=int, default=-1, help="test knob: worker 1 raises at this step")
    args = parser.parse_args()
    own_first, own_last = map(int, args.own_profiler.split(",")) if args.own_profiler else (-1, -1)

    kv = mx.kv.create(args.kvstore)
    worker, workers = kv.rank, kv.num_workers
    mx.random.seed(worker)
    net = build(args.model, args.width)
    contexts = [mx.cpu(i) for i in range(args.contexts)]
    net.initialize(mx.init.Xavier(), ctx=contexts)
    if not args.no_hybridize:
        net.hybridize()
    params = {"learning_rate": 0.01}
    if args.optimizer == "sgd":
        params["momentum"] = 0.9
    trainer = gluon.Trainer(net.collect_params(), args.optimizer, params, kvstore=kv)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    x = mx.nd.random.normal(shape=(args.batch_size, 3, 32, 32))
    y = mx.nd.random.randint(0, 10, shape=(args.batch_size,)).astype("float32")
    times = []
    batches = None
    for step in range(args.steps):
        if step == args.fail_at_step and worker == 1:
            raise RuntimeError(f"injected failure at step {step} (--fail-at-step)")
        if args.loader_workers and step % 8 == 0:  # the previous loader (and its pool) dropped here
            dataset = gluon.data.ArrayDataset(mx.nd.random.normal(shape=(8 * args.batch_size, 3, 32, 32)),
                                              mx.nd.random.randint(0, 10, shape=(8 * args.batch_size,)))
            batches = iter(gluon.data.DataLoader(dataset, batch_size=args.batch_size, num_workers=args.loader_workers))
        if batches is not None:
            xb, yb = next(batches)
            x, y = xb.as_in_context(mx.cpu()), yb.as_in_context(mx.cpu()).astype("float32")
        if step == own_first:
            import tempfile

            own_file = os.path.join(tempfile.mkdtemp(prefix="own_profiler_"), "profile.json")
            mx.profiler.set_config(profile_all=True, filename=own_file)
            mx.profiler.set_state("run")
        started = time.perf_counter()
        with autograd.record():
            losses = [loss_fn(net(xs), ys) for xs, ys in zip(gluon.utils.split_and_load(x, contexts),
                                                             gluon.utils.split_and_load(y, contexts))]
        autograd.backward(losses)
        trainer.step(args.batch_size * workers)
        losses[-1].wait_to_read()
        times.append(time.perf_counter() - started)
        if args.validate_every and (step + 1) % args.validate_every == 0:
            correct = sum(float((net(x).argmax(axis=1) == y).sum().asscalar()) for _ in range(4))
            if worker == 0 and step + 1 == args.validate_every:
                print(f"worker 0: validation accuracy {correct / (4 * args.batch_size):.3f}", flush=True)
        if step == own_last:
            mx.profiler.set_state("stop")
            mx.profiler.dump()  # finished=True: MXNet's periodic dump ends with it
            print(f"worker {worker}: own profile in {own_file}", flush=True)
    mx.nd.waitall()
    if worker == 0:
        tail = times[len(times) // 2:]
        print(f"worker 0 of {workers}: median iteration {statistics.median(tail) * 1000:.2f} ms "
              f"({len(tail)} iterations, {os.environ.get('DMLC_NUM_SERVER', '?')} servers)", flush=True)


if __name__ == "__main__":
    main()
