"""PyTorch scripts of shapes not tuned for (session 40), one flag each; run with `dprorun -np 2 python ddp_session40.py`.

--tensor-parallel: no DDP; an MLP split over the 2 ranks with torch.distributed.tensor.parallel (ColwiseParallel
then RowwiseParallel on a CPU device mesh): DTensor parameters, an all-reduce inside every forward and backward
through functional collectives, the optimizer stepping DTensors. --pipeline: no DDP; the MLP cut into two stages
with torch.distributed.pipelining (ScheduleGPipe, 4 micro-batches): activations sent rank 0 -> 1, gradients back.
--sam: DDP with sharpness-aware minimization (two forward/backward passes a step: the weights perturbed after the
first, the base optimizer stepping after the second; the optimizer's own step() is never called). --fp16-scaler: DDP
under CPU autocast float16 with torch.amp.GradScaler("cpu") (its first steps skipped on overflow, the scale halved).
"""
import argparse, statistics, time
import torch, torch.distributed as dist, torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser(); p.add_argument("--steps", type=int, default=40)
for flag in ("--tensor-parallel", "--pipeline", "--sam", "--fp16-scaler"):
    p.add_argument(flag, action="store_true")
a = p.parse_args()
dist.init_process_group("gloo"); torch.manual_seed(0); torch.set_num_threads(1)
rank, world = dist.get_rank(), dist.get_world_size()


def mlp():
    return nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))


class SAM(torch.optim.Optimizer):
    """Sharpness-aware minimization over a base optimizer (Foret et al.): ascend to w + e(w), descend from there."""

    def __init__(self, params, base, rho=0.05, **kwargs):
        super().__init__(params, dict(rho=rho, **kwargs))
        self.base = base(self.param_groups, **kwargs)
        self.param_groups = self.base.param_groups

    @torch.no_grad()
    def first_step(self):
        norm = torch.norm(torch.stack([p.grad.norm() for g in self.param_groups for p in g["params"]
                                       if p.grad is not None]))
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    e = p.grad * group["rho"] / (norm + 1e-12)
                    p.add_(e)
                    self.state[p]["e"] = e
        self.zero_grad()

    @torch.no_grad()
    def second_step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if "e" in self.state[p]:
                    p.sub_(self.state[p]["e"])
        self.base.step()
        self.zero_grad()


x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
times = []
if a.tensor_parallel:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world,))
    model = parallelize_module(mlp(), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=False)

    def step():
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
elif a.pipeline:
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    full = mlp()
    part = full[:2] if rank == 0 else full[2:]
    stage = PipelineStage(part, rank, world, torch.device("cpu"))
    schedule = ScheduleGPipe(stage, n_microbatches=4, loss_fn=F.cross_entropy)
    opt = torch.optim.SGD(part.parameters(), lr=0.01, momentum=0.9)

    def step():
        opt.zero_grad()
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y, losses=[])
        opt.step()
else:
    model = nn.parallel.DistributedDataParallel(mlp())
    if a.sam:
        opt = SAM(model.parameters(), torch.optim.SGD, lr=0.05, momentum=0.9)

        def step():
            F.cross_entropy(model(x), y).backward()
            opt.first_step()
            F.cross_entropy(model(x), y).backward()
            opt.second_step()
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        scaler = torch.amp.GradScaler("cpu", enabled=a.fp16_scaler)

        def step():
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16, enabled=a.fp16_scaler):
                loss = F.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
for _ in range(a.steps):
    t = time.perf_counter()
    step()
    times.append(time.perf_counter() - t)
if rank == 0:
    print(f"median iteration time: {statistics.median(times[len(times)//2:]) * 1000:.3f} ms")
dist.destroy_process_group()
