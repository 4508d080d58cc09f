"""DDP shapes of session 35. --lbfgs: torch.optim.LBFGS, whose step runs the closure (forward and backward, DDP's
all-reduce) up to 4 times; --localsgd: post-local SGD as torch's documentation shows it (the post_localSGD comm hook
from step 8, a PeriodicModelAverager all-reducing the parameters every 4 steps outside DDP; on CPU the subgroup's
size must be given)."""
import argparse, statistics, time
import torch, torch.distributed as dist, torch.nn as nn
p = argparse.ArgumentParser(); p.add_argument("--steps", type=int, default=40)
p.add_argument("--lbfgs", action="store_true"); p.add_argument("--localsgd", action="store_true")
a = p.parse_args()
dist.init_process_group("gloo"); torch.manual_seed(0); torch.set_num_threads(1)
DDP = nn.parallel.DistributedDataParallel
x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
times = []
if a.lbfgs:
    model = DDP(nn.Sequential(nn.Linear(256, 512), nn.Tanh(), nn.Linear(512, 10)))
    opt = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=4, history_size=5)

    def closure():
        opt.zero_grad(); loss = nn.functional.cross_entropy(model(x), y); loss.backward(); return loss

    def step_fn():
        opt.step(closure)
elif a.localsgd:
    import torch.distributed.algorithms.model_averaging.averagers as averagers
    from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook
    model = DDP(nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)))
    subgroup, _ = dist.new_subgroups(group_size=dist.get_world_size())
    model.register_comm_hook(PostLocalSGDState(process_group=None, subgroup=subgroup, start_localSGD_iter=8),
                             post_localSGD_hook)
    averager = averagers.PeriodicModelAverager(period=4, warmup_steps=8)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step_fn():
        opt.zero_grad(); nn.functional.cross_entropy(model(x), y).backward(); opt.step()
        averager.average_parameters(model.parameters())
else:
    raise SystemExit("choose a shape")
for step in range(a.steps):
    t = time.perf_counter(); step_fn(); times.append(time.perf_counter() - t)
if dist.get_rank() == 0:
    print(f"median iteration time: {statistics.median(times[len(times)//2:]) * 1000:.3f} ms")
dist.barrier(); dist.destroy_process_group()
