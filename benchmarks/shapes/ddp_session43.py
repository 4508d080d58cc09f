"""PyTorch scripts of shapes not tuned for (session 43), one flag each; run with `dprorun -np 2 python
ddp_session43.py`.

--bn-buffers: a BatchNorm conv net under DDP's default broadcast_buffers=True (rank 0's running statistics broadcast
at every forward, a collective outside the buckets). --skip-steps: the optimizer step skipped every 4th step when
the gradients' norm is over a bound (forward, backward and all-reduce ran; the gradients are zeroed). --time-budget:
the loop trains until 6 s have passed, not for a number of steps (each step all-reduces the stop flag, MAX, so that
every rank stops at the same step: the ranks' clocks read 6 s at different steps otherwise). --adafactor: a token
model (embedding with padding_idx, multi-head attention, label smoothing) stepped by torch.optim.Adafactor.
--bf16-hook: DDP's bf16_compress_hook.
"""
import argparse, statistics, time
import torch, torch.distributed as dist, torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser(); p.add_argument("--steps", type=int, default=40)
for flag in ("--bn-buffers", "--skip-steps", "--time-budget", "--adafactor", "--bf16-hook"):
    p.add_argument(flag, action="store_true")
a = p.parse_args()
dist.init_process_group("gloo"); torch.manual_seed(0); torch.set_num_threads(1)
rank, world = dist.get_rank(), dist.get_world_size()


class Tokens(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(2000, 128, padding_idx=0)
        self.attn = nn.MultiheadAttention(128, 4, batch_first=True)
        self.ff = nn.Sequential(nn.LayerNorm(128), nn.Linear(128, 512), nn.GELU(), nn.Linear(512, 128))
        self.out = nn.Linear(128, 2000)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        h = h + self.attn(h, h, h, need_weights=False)[0]
        return self.out(h + self.ff(h))


if a.bn_buffers:
    net = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                        nn.Conv2d(32, 64, 3, padding=1, stride=2), nn.BatchNorm2d(64), nn.ReLU(),
                        nn.Conv2d(64, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
                        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))
    x, y = torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))
elif a.adafactor:
    net = Tokens()
    x = torch.randint(0, 2000, (16, 32)); x[:, 24:] = 0
    y = torch.randint(1, 2000, (16, 32))
else:
    net = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
    x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
model = nn.parallel.DistributedDataParallel(net, bucket_cap_mb=2)
if a.bf16_hook:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    model.register_comm_hook(None, default_hooks.bf16_compress_hook)
opt = (torch.optim.Adafactor(model.parameters(), lr=0.01) if a.adafactor
       else torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
times: list[float] = []
start, step = time.perf_counter(), 0


def go_on() -> bool:
    if not a.time_budget:
        return step < a.steps
    flag = torch.tensor([float(time.perf_counter() - start >= 6.0)])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag.item() == 0.0


while go_on():
    t = time.perf_counter()
    opt.zero_grad()
    out = model(x)
    loss = (F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1), label_smoothing=0.1, ignore_index=0)
            if a.adafactor else F.cross_entropy(out, y))
    loss.backward()
    if a.skip_steps and step % 4 == 3:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
        if norm >= 0:  # always true: a bound that this run's gradients exceed, decided the same on every rank
            opt.zero_grad()
    else:
        opt.step()
    times.append(time.perf_counter() - t)
    step += 1
if rank == 0:
    print(f"steps: {step}; median iteration time: {statistics.median(times[len(times)//2:]) * 1000:.3f} ms")
dist.destroy_process_group()
