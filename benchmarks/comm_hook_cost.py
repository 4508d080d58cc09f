"""Cost of a Python DDP comm hook, in-process A/B: every rank trains several DDP copies of the same model in
turn (one per hook variant), so launch-to-launch noise does not enter the comparison.

Variants: DDP's built-in all-reduce (twice: "builtin" and "none", the second shows the noise floor), dprorun's
hook (runtime/ddp.py `_allreduce_mean`), torch's `allreduce_hook`, a hook without the division (not DDP's
semantics: only to split the cost), and the C++ builtin ALLREDUCE hook.

usage: python -m torch.distributed.run --standalone --nproc-per-node=2 benchmarks/comm_hook_cost.py
       [--example mlp_many_layers] [--bucket-mb 1] [--batch-size 128] [--rounds 6] [--steps 40]
       [--variants builtin,dprorun] [--switch-intervals 0.0005]  (also run each variant with that GIL interval)
"""
from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(REPO, "examples"), REPO]

from dprorun.runtime.ddp import _allreduce_mean  # noqa: E402


def torch_allreduce_hook(state, bucket):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    return allreduce_hook(None, bucket)


def no_division(state, bucket):
    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda fut: fut.value()[0])


def wrap(name: str, model: nn.Module, bucket_mb: float) -> DDP:
    ddp = DDP(model, bucket_cap_mb=bucket_mb)
    if name == "dprorun":
        ddp.register_comm_hook(None, _allreduce_mean)
    elif name == "torch_hook":
        ddp.register_comm_hook(None, torch_allreduce_hook)
    elif name == "no_division":
        ddp.register_comm_hook(None, no_division)
    elif name == "cpp_hook":
        ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
    return ddp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--example", default="mlp_many_layers")
    parser.add_argument("--bucket-mb", type=float, default=1.0)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--variants", default="builtin,none,dprorun,torch_hook,no_division,cpp_hook")
    parser.add_argument("--switch-intervals", default="",
                        help="comma-separated sys.setswitchinterval values (s) to run every variant under too")
    args = parser.parse_args()
    intervals = [sys.getswitchinterval()] + [float(x) for x in args.switch_intervals.split(",") if x]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    example = importlib.import_module(args.example)
    generator = torch.Generator().manual_seed(rank)
    inputs, targets = example.make_batch(args.batch_size, generator)
    loss_fn = nn.CrossEntropyLoss()
    variants = {}
    for name in args.variants.split(","):
        torch.manual_seed(0)
        model = example.build() if hasattr(example, "build") else example.Classifier()
        ddp = wrap(name, model, args.bucket_mb)
        variants[name] = (ddp, torch.optim.SGD(ddp.parameters(), lr=0.01))
    labels = {(name, iv): name if iv == intervals[0] else f"{name}@{iv * 1e3:g}ms"
              for iv in intervals for name in variants}
    times: dict[str, list[float]] = {label: [] for label in labels.values()}
    for _ in range(args.rounds):
        for (name, interval), label in labels.items():
            ddp, optimizer = variants[name]
            sys.setswitchinterval(interval)
            dist.barrier()
            steps = []
            for _ in range(args.steps):
                start = time.perf_counter()
                optimizer.zero_grad()
                loss_fn(ddp(inputs), targets).backward()
                optimizer.step()
                steps.append(time.perf_counter() - start)
            times[label].append(1e3 * statistics.median(steps[5:]))
    if rank == 0:
        base = statistics.median(times[next(iter(times))])
        print(f"{'variant':18} {'median ms':>10} {'vs first':>9}  per round")
        for label, values in times.items():
            print(f"{label:18} {statistics.median(values):10.2f} {100 * (statistics.median(values) / base - 1):+8.1f}%  "
                  f"{[round(v, 1) for v in values]}")
        if "dprorun" in times and "builtin" in times:
            print(f"dprorun's comm hook vs DDP's built-in all-reduce: "
                  f"{100 * (statistics.median(times['dprorun']) / statistics.median(times['builtin']) - 1):+.1f} %")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
