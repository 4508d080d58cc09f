"""DDP shapes not tuned for (session 51): `dprorun -np 2 python ddp_session51.py --save-on-cpu`.

--save-on-cpu: the forward under torch.autograd.graph.save_on_cpu() (activation offloading: autograd's saved tensors
packed to the host), a pre-norm MLP block stack with AdamW.
--compiled-step: the optimizer's step compiled (`torch.compile` of a function calling opt.step(), torch's "compiling
the optimizer" recipe), Adam with a LinearLR warm-up.
--plateau: a validation loss over 4 batches (model.eval(), no_grad) all-reduced every 10 steps and fed to
ReduceLROnPlateau; SGD with momentum.
--custom-function: a custom autograd.Function in the model (a straight-through rounding of the activations),
RMSprop.
--swa: stochastic weight averaging from step 30 (AveragedModel, SWALR), the average's BatchNorm statistics rebuilt
by update_bn at the end; a conv net with BatchNorm.
--async-checkpoint: torch.distributed.checkpoint.async_save of the model's and optimizer's state every 10 steps (the
previous save waited for first; a gloo group of their own, as torch advises for saves beside training), AdamW.
--backward-hook: a full backward hook of the script's on the DDP module (the gradient norm of its output logged), and
a forward hook of its own counting calls; SGD.
"""
import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

p = argparse.ArgumentParser()
for flag in ("--save-on-cpu", "--compiled-step", "--plateau", "--custom-function", "--swa", "--async-checkpoint",
             "--backward-hook"):
    p.add_argument(flag, action="store_true")
p.add_argument("--steps", type=int, default=60)
a = p.parse_args()
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)


class RoundST(torch.autograd.Function):
    """Rounds to a 1/16 grid forward, passes the gradient straight through backward."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x * 16) / 16

    @staticmethod
    def backward(ctx, grad):
        return grad


class Rounded(nn.Module):
    def forward(self, x):
        return RoundST.apply(x)


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


if a.swa:
    net = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
                        nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.AdaptiveAvgPool2d(2),
                        nn.Flatten(), nn.Linear(256, 10))
    x, y = torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,))
elif a.custom_function:
    net = nn.Sequential(nn.Linear(256, 512), Rounded(), nn.ReLU(), nn.Linear(512, 512), Rounded(), nn.ReLU(),
                        nn.Linear(512, 10))
    x, y = torch.randn(128, 256), torch.randint(0, 10, (128,))
else:
    net = nn.Sequential(nn.Linear(256, 384), *[Block(384) for _ in range(4)], nn.Linear(384, 10))
    x, y = torch.randn(128, 256), torch.randint(0, 10, (128,))
model = DDP(net)
loss_fn = nn.CrossEntropyLoss()
schedule = None
if a.save_on_cpu or a.async_checkpoint:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
elif a.compiled_step:
    opt = torch.optim.Adam(model.parameters(), lr=torch.tensor(1e-3))
    schedule = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=10)
elif a.custom_function:
    opt = torch.optim.RMSprop(model.parameters(), lr=1e-3)
else:
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
grad_norms, forwards = [], [0]
if a.backward_hook:
    model.register_full_backward_hook(lambda module, grad_in, grad_out: grad_norms.append(grad_out[0].norm().item()))
    model.register_forward_hook(lambda module, inputs, output: forwards.__setitem__(0, forwards[0] + 1))
pending_save = None
checkpoint_group = dist.new_group(backend="gloo") if a.async_checkpoint else None  # the saves' own group (torch's advice)
plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=1) if a.plateau else None
swa_model = torch.optim.swa_utils.AveragedModel(net) if a.swa else None
swa_schedule = torch.optim.swa_utils.SWALR(opt, swa_lr=0.01, anneal_epochs=5) if a.swa else None


@torch.compile
def compiled_step():
    opt.step()


def validate() -> float:
    model.eval()
    with torch.no_grad():
        total = sum(loss_fn(model(torch.randn_like(x)), y) for _ in range(4)) / 4
    model.train()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


times = []
for step in range(a.steps):
    start = time.perf_counter()
    opt.zero_grad()
    if a.save_on_cpu:
        with torch.autograd.graph.save_on_cpu():
            loss = loss_fn(model(x), y)
    else:
        loss = loss_fn(model(x), y)
    loss.backward()
    if a.compiled_step:
        compiled_step()
    else:
        opt.step()
    if schedule is not None:
        schedule.step()
    if plateau is not None and step % 10 == 9:
        plateau.step(validate())
    if a.async_checkpoint and step % 10 == 9:
        import tempfile

        import torch.distributed.checkpoint as dcp

        if pending_save is not None:
            pending_save.result()
        folder = os.path.join(tempfile.gettempdir(), f"dprorun-shape-dcp-{os.environ.get('MASTER_PORT', '0')}")
        pending_save = dcp.async_save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=folder,
                                      process_group=checkpoint_group)
    if swa_model is not None and step >= 30:
        swa_model.update_parameters(net)
        swa_schedule.step()
    times.append(time.perf_counter() - start)
if pending_save is not None:
    pending_save.result()
if a.backward_hook and len(grad_norms) != a.steps or forwards[0] not in (0, a.steps) and a.backward_hook:
    raise SystemExit(f"the script's own hooks ran {len(grad_norms)} / {forwards[0]} times for {a.steps} steps")
if swa_model is not None:
    torch.optim.swa_utils.update_bn([(torch.randn_like(x), y) for _ in range(4)], swa_model)
if rank == 0:
    print(f"median step {1000 * statistics.median(times[10:]):.2f} ms, loss {loss.item():.4f}", flush=True)
dist.destroy_process_group()
