"""Shared plumbing of the bundled examples: argument parsing, process-group set-up and the training loop.

The examples are ordinary torch.distributed + DistributedDataParallel scripts: they run the same under
`torchrun` and under `dprorun` and do not need dprorun. Where it is installed they ask `dprorun.strategy()`
for gradient accumulation (the one strategy setting a script has to apply itself); None outside dprorun.
"""
import argparse
import contextlib
import gc
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def parse_args(description: str, add_arguments=None, **defaults) -> argparse.Namespace:
    """The examples' shared options; `add_arguments(parser)` adds an example's own."""
    parser = argparse.ArgumentParser(description=description)
    if add_arguments is not None:
        add_arguments(parser)
    parser.add_argument("--steps", type=int, default=defaults.get("steps", 30))
    parser.add_argument("--batch-size", type=int, default=defaults.get("batch_size", 32))
    parser.add_argument("--bucket-mb", type=float, default=None,
                        help="DDP bucket_cap_mb (default: DDP's own, 25 MB with a 1 MiB first bucket)")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--optimizer", choices=("sgd", "adam", "adagrad"), default=defaults.get("optimizer", "sgd"),
                        help="sgd (momentum 0.9), adam or adagrad (per-parameter state)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--accumulate", type=int, default=1,
                        help="micro-batches per optimizer step (DDP's no_sync for all but the last; default: 1, or "
                        "what a dprorun strategy asks for)")
    parser.add_argument("--closure", action="store_true",
                        help="optimizer.step(closure), the closure running forward and backward (Lightning's "
                        "automatic optimization does this)")
    parser.add_argument("--comm-hook", choices=("none", "allreduce", "fp16", "bf16", "powersgd"), default="none",
                        help="DDP comm hook of torch's: its plain all-reduce in Python (allreduce_hook), gradients "
                        "sent as fp16 / bf16 (half the bytes), or PowerSGD (rank 2)")
    parser.add_argument("--backend", choices=("auto", "gloo", "nccl", "none"), default="auto",
                        help="process-group backend (auto: nccl with a GPU, gloo without; none: init_process_group() "
                             "without one, torch choosing per device)")
    parser.add_argument("--own-profiler", default="",
                        help="FIRST,LAST[,RANKS]: the script profiles steps FIRST-LAST itself with torch.profiler (a "
                             "schedule, as a user's script does; RANKS 'all' or '0', default all), traces to a "
                             "temporary folder")
    parser.add_argument("--fsdp", action="store_true",
                        help="shard the model with FSDP2 instead of DDP: fully_shard on each of its top-level "
                             "children holding parameters, then on the whole model (--bucket-mb and --comm-hook do "
                             "not apply)")
    parser.add_argument("--fail-at-step", type=int, default=-1, help="test knob: raise at this step")
    parser.add_argument("--fail-rank", type=int, default=1, help="test knob: the rank that fails")
    parser.add_argument("--fail-mode", choices=("raise", "sigkill"), default="raise",
                        help="test knob: raise an exception or SIGKILL itself (as the OOM killer would)")
    return parser.parse_args()


def init_distributed(backend: str = "auto") -> tuple[int, int, torch.device]:
    """Process group + this rank's device. Ranks share GPUs round-robin when there are fewer GPUs than local
    ranks (NCCL refuses that; gloo over CUDA tensors accepts it)."""
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend=None if backend == "none" else backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        index = local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return rank, world, torch.device("cuda", index)
    return rank, world, torch.device("cpu")


def accumulation_steps() -> int:
    """Micro-batches per optimizer step asked for by a dprorun strategy (`dprorun.strategy()`; 1 under plain
    torchrun or without one): the one setting the hooks cannot apply, since it changes the script's batches."""
    try:
        import dprorun
    except ImportError:
        return 1
    strategy = dprorun.strategy()
    return max(1, int(strategy.accumulation_steps)) if strategy is not None else 1


def make_optimizer(params, args: argparse.Namespace) -> torch.optim.Optimizer:
    if args.optimizer == "adam":
        return torch.optim.Adam(params, lr=args.lr)
    if args.optimizer == "adagrad":
        return torch.optim.Adagrad(params, lr=args.lr)
    return torch.optim.SGD(params, lr=args.lr, momentum=0.9)


def start_own_profiler(spec: str, rank: int, device: torch.device):
    """--own-profiler FIRST,LAST[,RANKS]: torch.profiler over those steps, started here (None: not asked); on a GPU
    it records CUDA kernels too, as a user's script does."""
    if not spec:
        return None
    first, last, *ranks = spec.split(",")
    if ranks and ranks[0] != "all" and rank != int(ranks[0]):
        return None
    import tempfile

    from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

    folder = tempfile.mkdtemp(prefix="own_profiler_")
    warmup = 1 if int(first) > 0 else 0
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    profiler = profile(activities=activities, on_trace_ready=tensorboard_trace_handler(folder),
                       schedule=schedule(wait=int(first) - warmup, warmup=warmup, active=int(last) - int(first) + 1,
                                         repeat=1))
    profiler.start()
    print(f"rank {rank}: own profiler traces in {folder}", flush=True)
    return profiler


def fsdp2(model: torch.nn.Module) -> torch.nn.Module:
    """FSDP2: each top-level child that holds parameters sharded on its own (gathered before its forward and again
    before its backward, its gradients reduce-scattered; a ModuleList's or ModuleDict's members each, as they have no
    forward of their own), then the whole model (the rest of its parameters)."""
    from torch.distributed.fsdp import fully_shard

    for child in model.children():
        members = child.values() if isinstance(child, torch.nn.ModuleDict) else \
            child if isinstance(child, torch.nn.ModuleList) else [child]
        for unit in members:
            if any(p.requires_grad for p in unit.parameters()):
                fully_shard(unit)
    fully_shard(model)
    return model


def train(model: torch.nn.Module, make_batch, loss_fn, args: argparse.Namespace) -> None:
    """Synthetic-data training loop; rank 0 prints the median step time of the second half of the run."""
    rank, world, device = init_distributed(args.backend)
    micro_batches = args.accumulate if args.accumulate > 1 else accumulation_steps()
    if micro_batches > 1 and rank == 0 and args.accumulate <= 1:
        print(f"accumulating gradients over {micro_batches} micro-batches (dprorun strategy)", flush=True)
    torch.manual_seed(args.seed)
    model = model.to(device)
    ddp = fsdp2(model) if args.fsdp else DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                                              bucket_cap_mb=args.bucket_mb)
    if args.fsdp:
        if micro_batches > 1:
            raise SystemExit("--fsdp: no gradient accumulation here (DDP's no_sync is what the loop uses)")
    elif args.comm_hook == "powersgd":  # low-rank compression from the third step on (its first two: all-reduces)
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=2)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    elif args.comm_hook != "none":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        name = "allreduce_hook" if args.comm_hook == "allreduce" else f"{args.comm_hook}_compress_hook"
        ddp.register_comm_hook(None, getattr(default_hooks, name))
    optimizer = make_optimizer([p for p in ddp.parameters() if p.requires_grad], args)
    generator = torch.Generator().manual_seed(args.seed + rank)
    step_times = []
    own_profiler = start_own_profiler(args.own_profiler, rank, device)
    for step in range(args.steps):
        if step == args.fail_at_step and rank == args.fail_rank:
            if args.fail_mode == "sigkill":
                os.kill(os.getpid(), 9)
            raise RuntimeError(f"injected failure at step {step} on rank {rank}")
        start = time.perf_counter()
        inputs, targets = make_batch(args.batch_size, generator)
        inputs, targets = inputs.to(device), targets.to(device)
        optimizer.zero_grad(set_to_none=True)
        if micro_batches > 1:  # same global batch in pieces; gradients synchronised once, with the last piece
            pieces = list(zip(torch.chunk(inputs, micro_batches), torch.chunk(targets, micro_batches)))
            for k, (piece_in, piece_target) in enumerate(pieces):
                with ddp.no_sync() if k < len(pieces) - 1 else contextlib.nullcontext():
                    loss = loss_fn(ddp(piece_in), piece_target) / len(pieces)
                    loss.backward()
        elif args.closure:
            def closure():
                loss = loss_fn(ddp(inputs), targets)
                loss.backward()
                return loss
        else:
            loss = loss_fn(ddp(inputs), targets)
            loss.backward()
        if args.closure and micro_batches == 1:
            loss = optimizer.step(closure)
        else:
            optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        step_times.append(time.perf_counter() - start)
        if own_profiler is not None:
            own_profiler.step()
    if own_profiler is not None:
        own_profiler.stop()
    tail = step_times[len(step_times) // 2:] or step_times
    if rank == 0:
        print(f"world size {world}, {args.steps} steps, loss {loss.item():.4f}, "
              f"median iteration time: {statistics.median(tail) * 1000:.3f} ms", flush=True)
    # leave together, the model (which holds the process group) freed first: a rank that tears its group down while
    # the other still talks to it, or whose group outlives the script, has now and then aborted at exit
    # ("terminate called without an active exception") on this machine
    ddp = model = optimizer = None  # (ddp is also the closure's)
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
