"""Horovod (horovod.torch) shapes of session 36: --eval-every N (a validation pass over 4 held-out batches under
torch.no_grad() and model.eval() after every N-th step), --accum-loop (gradient
accumulation by hand over 2 micro-batches with backward_passes_per_step=2 and an SGD momentum optimizer), --gan (a GAN: a DistributedOptimizer each for the discriminator and the generator,
stepped in turn every step; --sample-every N: the generator samples images every N steps)."""
import argparse, statistics, time
import torch, torch.nn as nn
import horovod.torch as hvd
p = argparse.ArgumentParser(); p.add_argument("--steps", type=int, default=40)
p.add_argument("--eval-every", type=int, default=0); p.add_argument("--accum-loop", action="store_true")
p.add_argument("--gan", action="store_true")
p.add_argument("--sample-every", type=int, default=0, help="--gan: the generator samples 16 images under no_grad")
a = p.parse_args()
hvd.init(); torch.manual_seed(0); torch.set_num_threads(1)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1),
                                   nn.ReLU(), nn.AdaptiveAvgPool2d(4))
        self.head = nn.Linear(32 * 16, 10)

    def forward(self, x):
        return self.head(self.trunk(x).flatten(1))


if a.gan:
    gen = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 784))
    disc = nn.Sequential(nn.Linear(784, 256), nn.LeakyReLU(0.2), nn.Linear(256, 1))
    d_opt = hvd.DistributedOptimizer(torch.optim.Adam(disc.parameters(), lr=2e-4),
                                     named_parameters=[("d." + n, q) for n, q in disc.named_parameters()])
    g_opt = hvd.DistributedOptimizer(torch.optim.Adam(gen.parameters(), lr=2e-4),
                                     named_parameters=[("g." + n, q) for n, q in gen.named_parameters()])
    real, bce, times = torch.randn(64, 784), nn.BCEWithLogitsLoss(), []
    ones, zeros = torch.ones(64, 1), torch.zeros(64, 1)
    for step in range(a.steps):
        t = time.perf_counter()
        fake = gen(torch.randn(64, 64))
        d_opt.zero_grad()
        (bce(disc(real), ones) + bce(disc(fake.detach()), zeros)).backward()
        d_opt.step()
        g_opt.zero_grad()
        disc.requires_grad_(False)  # the discriminator's gradients would be all-reduced by d_opt's hooks
        bce(disc(fake), ones).backward()
        disc.requires_grad_(True)
        g_opt.step()
        times.append(time.perf_counter() - t)
        if a.sample_every and (step + 1) % a.sample_every == 0:
            gen.eval()
            with torch.no_grad():
                gen(torch.randn(16, 64))
            gen.train()
    if hvd.rank() == 0:
        print(f"median iteration time: {statistics.median(times[len(times)//2:]) * 1000:.3f} ms")
    raise SystemExit(0)
model = Net()
accum = 2 if a.accum_loop else 1
if a.accum_loop:
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
else:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), backward_passes_per_step=accum)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
x = torch.randn(32, 3, 32, 32); y = torch.randint(0, 10, (32,))
held_out = [torch.randn(64, 3, 32, 32) for _ in range(4)]
times = []
for step in range(a.steps):
    t = time.perf_counter()
    opt.zero_grad()
    for micro in range(accum):
        loss = nn.functional.cross_entropy(model(x[micro::accum]), y[micro::accum]) / accum
        loss.backward()
    opt.step()
    times.append(time.perf_counter() - t)
    if a.eval_every and (step + 1) % a.eval_every == 0:
        model.eval()
        with torch.no_grad():
            hits = sum(int((model(b).argmax(1) == 0).sum()) for b in held_out)
        model.train()
        assert hits >= 0
if hvd.rank() == 0:
    print(f"median iteration time: {statistics.median(times[len(times)//2:]) * 1000:.3f} ms")
