"""DDP shapes of session 34. --distill: a frozen teacher (no DDP) runs forward under no_grad every step, a student
in DDP learns from it; --two-ddp: encoder and decoder wrapped in a DDP each, one loss, one optimizer; --tied: an
embedding and the output projection share one weight (a parameter used twice in forward); --ema: an AveragedModel
updated after every step, a step LR schedule; --grad-hooks: the script's own per-parameter gradient hooks (clamping
each gradient); --dynamic: find_unused_parameters with one of three branches drawn every step (same on all ranks);
--short-epochs: a DistributedSampler over 150 samples (5 steps an epoch, the last batch short), set_epoch."""
import argparse, statistics, time
import torch, torch.distributed as dist, torch.nn as nn
p = argparse.ArgumentParser(); p.add_argument("--steps", type=int, default=40)
for flag in ("distill", "two-ddp", "tied", "ema", "grad-hooks", "dynamic", "short-epochs"):
    p.add_argument("--" + flag, action="store_true")
a = p.parse_args()
dist.init_process_group("gloo"); torch.manual_seed(0); torch.set_num_threads(1)
DDP = nn.parallel.DistributedDataParallel
rank = dist.get_rank()
def mlp(i, h, o): return nn.Sequential(nn.Linear(i, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, o))
times = []
x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))


class TiedLM(nn.Module):
    def __init__(self, vocab=4000, dim=256):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim); self.body = mlp(dim, 512, dim); self.out = nn.Linear(dim, vocab)
        self.out.weight = self.embed.weight  # tied

    def forward(self, tokens):
        return self.out(self.body(self.embed(tokens).mean(dim=1)))


class Branchy(nn.Module):
    def __init__(self):
        super().__init__(); self.trunk = mlp(256, 512, 256); self.branches = nn.ModuleList(mlp(256, 512, 10) for _ in range(3))

    def forward(self, inputs, which):
        return self.branches[which](self.trunk(inputs))


def timed(step_fn):
    for step in range(a.steps):
        t = time.perf_counter(); step_fn(step); times.append(time.perf_counter() - t)


if a.distill:
    teacher = mlp(256, 1024, 10).eval().requires_grad_(False)
    student = DDP(mlp(256, 256, 10)); opt = torch.optim.SGD(student.parameters(), 0.01, momentum=0.9)
    def step_fn(step):
        with torch.no_grad():
            soft = teacher(x).softmax(-1)
        opt.zero_grad()
        out = student(x)
        loss = nn.functional.kl_div(out.log_softmax(-1), soft, reduction="batchmean") + nn.functional.cross_entropy(out, y)
        loss.backward(); opt.step()
elif a.two_ddp:
    enc, dec = DDP(mlp(256, 512, 128), bucket_cap_mb=1), DDP(mlp(128, 512, 10), bucket_cap_mb=1)
    opt = torch.optim.Adam(list(enc.parameters()) + list(dec.parameters()), 1e-4)
    def step_fn(step):
        opt.zero_grad(); nn.functional.cross_entropy(dec(enc(x)), y).backward(); opt.step()
elif a.tied:
    model = DDP(TiedLM()); opt = torch.optim.SGD(model.parameters(), 0.01)
    tokens = torch.randint(0, 4000, (64, 16))
    def step_fn(step):
        opt.zero_grad(); nn.functional.cross_entropy(model(tokens), tokens[:, 0]).backward(); opt.step()
elif a.ema:
    model = DDP(mlp(256, 1024, 10)); opt = torch.optim.SGD(model.parameters(), 0.01, momentum=0.9)
    ema = torch.optim.swa_utils.AveragedModel(model.module, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.999))
    sched = torch.optim.lr_scheduler.StepLR(opt, 10, 0.5)
    def step_fn(step):
        opt.zero_grad(); nn.functional.cross_entropy(model(x), y).backward(); opt.step(); sched.step()
        ema.update_parameters(model.module)
elif a.grad_hooks:
    net = mlp(256, 1024, 10)
    for prm in net.parameters():
        prm.register_hook(lambda g: g.clamp(-0.05, 0.05))
    model = DDP(net); opt = torch.optim.SGD(model.parameters(), 0.01)
    def step_fn(step):
        opt.zero_grad(); nn.functional.cross_entropy(model(x), y).backward(); opt.step()
elif a.dynamic:
    model = DDP(Branchy(), find_unused_parameters=True); opt = torch.optim.SGD(model.parameters(), 0.01)
    draws = torch.Generator().manual_seed(7)  # the same draws on every rank
    def step_fn(step):
        which = int(torch.randint(0, 3, (1,), generator=draws))
        opt.zero_grad(); nn.functional.cross_entropy(model(x, which), y).backward(); opt.step()
elif a.short_epochs:
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
    data = TensorDataset(torch.randn(150, 256), torch.randint(0, 10, (150,)))
    sampler = DistributedSampler(data, shuffle=True)
    loader = DataLoader(data, batch_size=16, sampler=sampler)  # 75 samples a rank: 4 batches of 16 and one of 11
    model = DDP(mlp(256, 1024, 10)); opt = torch.optim.SGD(model.parameters(), 0.01)
    epoch, stream = 0, None
    def step_fn(step):
        global epoch, stream
        batch = next(stream, None) if stream is not None else None
        if batch is None:
            sampler.set_epoch(epoch); epoch += 1; stream = iter(loader); batch = next(stream)
        opt.zero_grad(); nn.functional.cross_entropy(model(batch[0]), batch[1]).backward(); opt.step()
else:
    raise SystemExit("choose a shape")
timed(step_fn)
if rank == 0:
    print(f"median iteration time: {statistics.median(times[len(times)//2:]) * 1000:.3f} ms")
dist.barrier(); dist.destroy_process_group()
