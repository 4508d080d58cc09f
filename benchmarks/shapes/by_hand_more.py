"""More gradients all-reduced by the script itself (session 45), found with these: run with `dprorun -np 2 python
by_hand_more.py --gan` (or --subclass, --scaler-bf16).

--gan: a critic and a generator, each with its Adam, each all-reducing its own model's gradients (per parameter)
before its step: two optimizers stepped in turn, two models' buckets in one iteration.
--subclass: an SGD subclass whose step calls super().step(), with a StepLR made before the first step and the
gradients clipped after they are shared. --scaler-bf16: AdamW under bf16 autocast with a GradScaler (its step calls
the optimizer's), a StepLR made first, clipping after unscale_.
"""
import argparse, statistics, time
import torch, torch.distributed as dist, torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser(); p.add_argument("--steps", type=int, default=40)
for flag in ("--gan", "--subclass", "--scaler-bf16"):
    p.add_argument(flag, action="store_true")
a = p.parse_args()
dist.init_process_group("gloo"); torch.manual_seed(0); torch.set_num_threads(1)
world = dist.get_world_size()


def share(model: nn.Module) -> None:
    for prm in model.parameters():
        dist.all_reduce(prm.grad)
        prm.grad /= world


class SubclassedSGD(torch.optim.SGD):
    def step(self, closure=None):
        return super().step(closure)


def gan_step(G: nn.Module, D: nn.Module, og: torch.optim.Optimizer, od: torch.optim.Optimizer) -> None:
    od.zero_grad()
    loss_d = D(torch.randn(32, 64)).mean() - D(G(torch.randn(32, 16)).detach()).mean()
    loss_d.backward(); share(D); od.step()
    og.zero_grad()
    D(G(torch.randn(32, 16))).mean().backward(); share(G); og.step()


def main() -> None:
    times: list[float] = []
    if a.gan:
        G = nn.Sequential(nn.Linear(16, 256), nn.ReLU(), nn.Linear(256, 64))
        D = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1))
        og, od = torch.optim.Adam(G.parameters(), 1e-3), torch.optim.Adam(D.parameters(), 1e-3)
    else:
        net = nn.Sequential(nn.Linear(128, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
        opt = SubclassedSGD(net.parameters(), lr=0.05, momentum=0.9) if a.subclass else \
            torch.optim.AdamW(net.parameters(), 1e-3)
        sched = torch.optim.lr_scheduler.StepLR(opt, 10, 0.5)
        scaler = torch.amp.GradScaler("cpu", enabled=a.scaler_bf16)
        x, y = torch.randn(64, 128), torch.randint(0, 10, (64,))
    for _ in range(a.steps):
        t = time.perf_counter()
        if a.gan:
            gan_step(G, D, og, od)
        else:
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.scaler_bf16):
                loss = F.cross_entropy(net(x), y)
            scaler.scale(loss).backward()
            share(net)
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            scaler.step(opt); scaler.update(); sched.step()
        times.append(time.perf_counter() - t)
    if dist.get_rank() == 0:
        print(f"steps: {a.steps}; median iteration time: {statistics.median(times[len(times)//2:]) * 1000:.3f} ms")
    dist.barrier(); dist.destroy_process_group()


main()
