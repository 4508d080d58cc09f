"""Ranks the script starts itself (session 53): `dprorun python ddp_spawned.py --tutorial` (one process launched;
it spawns the job's ranks).

--tutorial: pytorch.org's "Getting Started with Distributed Data Parallel" shape: torch.multiprocessing.spawn of the
ranks, MASTER_ADDR / MASTER_PORT set by the script (a port it found free), init_process_group("gloo", rank=rank,
world_size=world_size), the ToyModel (Linear 512->1024, ReLU, Linear 1024->512), MSELoss, SGD.
--tcp: the same with init_method="tcp://127.0.0.1:<port>" and no MASTER_* variables; Adam; a conv net.
--fork: mp.start_processes(..., start_method="fork") (as in a notebook), MASTER_ADDR / MASTER_PORT given defaults
with os.environ.setdefault before the start (under a launcher, its values stay), AdamW.
--process: pytorch.org's "Writing Distributed Applications with PyTorch" shape: multiprocessing.Process per rank
(mp.set_start_method("spawn")), init_process(rank, size, fn) setting MASTER_ADDR / MASTER_PORT, gradients averaged
by hand (dist.all_reduce of each parameter's gradient after the backward), SGD with momentum.
--process-fork: the same with the fork start method.
--elastic-api: the workers started by torch elastic's Python API from the script
(torch.distributed.launcher.api.elastic_launch, its own c10d rendezvous and agent store), DDP of an MLP, SGD.
--subprocess-launcher: a launcher of the script's own: each rank this same file run again with subprocess.Popen
(`--subprocess-worker`), RANK / LOCAL_RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT in its environment, which
init_process_group reads (DDP of an MLP, SGD).
--torchrun-main: torchrun run from the script (torch.distributed.run.main([...]): an elastic agent of the script's
own, each rank this file run again as a subprocess with `--subprocess-worker`).
--fail-at-step N: rank 1 raises at step N (mp.spawn ends the others and raises in the launched process).
--world N: the number of ranks spawned (2).
"""
import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(512, 1024)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(1024, 512)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1),
                                      nn.ReLU(), nn.AdaptiveAvgPool2d(4), nn.Flatten())
        self.head = nn.Linear(64 * 16, 10)

    def forward(self, x):
        return self.head(self.features(x))


def train(rank: int, world_size: int, a: argparse.Namespace, port: int) -> None:
    torch.set_num_threads(1)
    if a.tcp:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    else:
        if a.tutorial:
            os.environ["MASTER_ADDR"] = "localhost"
            os.environ["MASTER_PORT"] = str(port)
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.manual_seed(rank)
    if a.tcp:
        model, make = ConvNet(), (lambda: (torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))))
        loss_fn, optimizer_class = nn.CrossEntropyLoss(), torch.optim.Adam
    else:
        model, make = ToyModel(), (lambda: (torch.randn(64, 512), torch.randn(64, 512)))
        loss_fn, optimizer_class = nn.MSELoss(), (torch.optim.AdamW if a.fork else torch.optim.SGD)
    ddp_model = DDP(model)
    optimizer = optimizer_class(ddp_model.parameters(), lr=0.001)
    times = []
    for step in range(a.steps):
        start = time.perf_counter()
        if a.fail_at_step is not None and step == a.fail_at_step and rank == 1:
            raise RuntimeError(f"rank 1 fails at step {step}")
        inputs, labels = make()
        optimizer.zero_grad()
        loss_fn(ddp_model(inputs), labels).backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
    if rank == 0:
        print(f"median step {1000 * statistics.median(times[len(times) // 2:]):.2f} ms")
    dist.barrier()
    dist.destroy_process_group()


def average_gradients(model: nn.Module) -> None:
    size = float(dist.get_world_size())
    for param in model.parameters():
        dist.all_reduce(param.grad.data, op=dist.ReduceOp.SUM)
        param.grad.data /= size


def run(rank: int, size: int, steps: int) -> None:
    torch.manual_seed(1234)
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.5)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(torch.randn(64, 512)), torch.randint(0, 10, (64,)))
        loss.backward()
        average_gradients(model)
        optimizer.step()
        times.append(time.perf_counter() - start)
    if rank == 0:
        print(f"median step {1000 * statistics.median(times[len(times) // 2:]):.2f} ms")


def init_process(rank: int, size: int, fn, port: int, steps: int, backend: str = "gloo") -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group(backend, rank=rank, world_size=size)
    fn(rank, size, steps)
    dist.barrier()
    dist.destroy_process_group()


def elastic_worker(steps: int) -> None:
    dist.init_process_group("gloo")  # from the environment the script's own agent gave the worker
    torch.set_num_threads(1)
    model = DDP(nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 512), nn.ReLU(), nn.Linear(512, 10)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(torch.randn(32, 256)), torch.randint(0, 10, (32,))).backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
    if dist.get_rank() == 0:
        print(f"median step {1000 * statistics.median(times[len(times) // 2:]):.2f} ms")
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    for flag in ("--tutorial", "--tcp", "--fork", "--process", "--process-fork", "--elastic-api",
                 "--subprocess-launcher", "--subprocess-worker", "--torchrun-main"):
        p.add_argument(flag, action="store_true")
    p.add_argument("--fail-at-step", type=int, default=None)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--steps", type=int, default=60)
    args = p.parse_args()
    if args.torchrun_main:
        from torch.distributed.run import main as torchrun

        torchrun([f"--nproc-per-node={args.world}", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0",
                  "--monitor-interval=0.1", os.path.abspath(__file__), "--subprocess-worker",
                  "--steps", str(args.steps)])
    elif args.subprocess_launcher:
        import subprocess
        import sys

        port = str(free_port())
        workers = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--subprocess-worker", "--steps",
                                     str(args.steps)],
                                    env=dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(args.world),
                                             MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
                   for r in range(args.world)]
        raise SystemExit(max(worker.wait() for worker in workers))
    elif args.subprocess_worker:
        elastic_worker(args.steps)
    elif args.elastic_api:
        import uuid

        from torch.distributed.launcher.api import LaunchConfig, elastic_launch

        config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=args.world, run_id=str(uuid.uuid4()),
                              rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", max_restarts=0,
                              monitor_interval=0.1, start_method="spawn")
        elastic_launch(config, elastic_worker)(args.steps)
    elif args.process or args.process_fork:
        mp.set_start_method("fork" if args.process_fork else "spawn")
        port = free_port()
        processes = []
        for r in range(args.world):
            process = mp.Process(target=init_process, args=(r, args.world, run, port, args.steps))
            process.start()
            processes.append(process)
        for process in processes:
            process.join()
        raise SystemExit(max(process.exitcode for process in processes))
    elif args.fork:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        mp.start_processes(train, args=(args.world, args, 0), nprocs=args.world, start_method="fork")
    else:
        mp.spawn(train, args=(args.world, args, free_port()), nprocs=args.world, join=True)
