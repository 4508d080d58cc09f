"""Many small linear layers trained with horovod.torch (DistributedOptimizer, Gloo controller on the CPU).

Runs unchanged under `horovodrun -np 2 --gloo python examples/horovod_mlp.py` and
`dprorun --backend horovod -np 2 python examples/horovod_mlp.py`; rank 0 prints the median step time of the
second half of the run (or of its last --report-last steps). `--model transformer` or `--model resnet` trains
the DDP examples' Transformer encoder or small ResNet instead (same builders and batches, under Horovod);
`--model convhead` a small conv trunk (two 3x3 convolutions) under a large linear head (16,384 -> 256 -> 10,
4.2 M parameters in the head, batch 16 at 32x32): one big tensor late in backward, a shape none of the others have;
`--model mixed` examples/mixed_dtype_mlp.py's model with a float16 trunk under a float32 head (Horovod has no
bfloat16; it fuses each dtype apart).
"""
import argparse
import importlib
import statistics
import time

import horovod.torch as hvd
import torch
from torch import nn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=24)
    parser.add_argument("--report-last", type=int, default=0,
                        help="median over the last N steps (default: the second half), e.g. after autotuning")
    parser.add_argument("--model", choices=("mlp", "transformer", "resnet", "convhead", "mixed"), default="mlp")
    parser.add_argument("--compression", choices=("none", "fp16"), default="none",
                        help="hvd.Compression for the all-reduces (fp16: half the bytes sent)")
    args = parser.parse_args()
    hvd.init()
    torch.manual_seed(0)
    if args.model == "mlp":
        layers = [nn.Linear(64, args.width), nn.ReLU()]
        for _ in range(args.depth):
            layers += [nn.Linear(args.width, args.width), nn.ReLU()]
        model = nn.Sequential(*layers, nn.Linear(args.width, 10))

        def make_batch(batch_size, generator):
            return (torch.randn(batch_size, 64, generator=generator),
                    torch.randint(0, 10, (batch_size,), generator=generator))
    elif args.model == "convhead":
        model = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
                              nn.MaxPool2d(2), nn.Flatten(), nn.Linear(64 * 16 * 16, 256), nn.ReLU(),
                              nn.Linear(256, 10))

        def make_batch(batch_size, generator):
            return (torch.randn(batch_size, 3, 32, 32, generator=generator),
                    torch.randint(0, 10, (batch_size,), generator=generator))
    elif args.model == "mixed":
        example = importlib.import_module("mixed_dtype_mlp")
        model, make_batch = example.MixedDtypeMLP(trunk_dtype=torch.float16), example.make_batch
    else:  # the DDP examples' model and batches (this file's directory is on sys.path when run as a script)
        example = importlib.import_module(f"{args.model}_small")
        model = example.Classifier() if args.model == "transformer" else example.build()
        make_batch = example.make_batch
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                         named_parameters=model.named_parameters(),
                                         compression=getattr(hvd.Compression, args.compression))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    generator = torch.Generator().manual_seed(hvd.rank())
    loss_fn = nn.CrossEntropyLoss()
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        inputs, targets = make_batch(args.batch_size, generator)
        optimizer.zero_grad()
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
    tail = (times[-args.report_last:] if args.report_last > 0 else times[len(times) // 2:]) or times
    if hvd.rank() == 0:
        print(f"world size {hvd.size()}, {args.steps} steps, loss {loss.item():.4f}, "
              f"median iteration time: {statistics.median(tail) * 1000:.3f} ms", flush=True)


if __name__ == "__main__":
    main()
