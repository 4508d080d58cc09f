"""Horovod (horovod.torch) shapes of session 37: --elastic (Horovod's elastic API: the loop inside a function
decorated with hvd.elastic.run over a TorchState holding the model, the optimizer and the step, state.commit()
every 5 steps, which saves the state and checks for host changes; launched as an ordinary fixed-size job),
--sum-op (the gradients summed, not averaged: DistributedOptimizer(op=hvd.Sum) with the learning rate divided by
the world size), --lamb-like (a LayerNorm MLP with AdamW, hvd.allreduce of the loss with op=hvd.Average
every step and a per-layer trust ratio computed by hand before the step)."""
import argparse, statistics, time
import torch, torch.nn as nn
import horovod.torch as hvd
p = argparse.ArgumentParser(); p.add_argument("--steps", type=int, default=40)
p.add_argument("--elastic", action="store_true"); p.add_argument("--sum-op", action="store_true")
p.add_argument("--lamb-like", action="store_true")
a = p.parse_args()
hvd.init(); torch.manual_seed(0); torch.set_num_threads(1)
layers = []
for _ in range(4):
    layers += [nn.Linear(512, 512), nn.LayerNorm(512) if a.lamb_like else nn.Identity(), nn.ReLU()]
model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), *layers, nn.Linear(512, 10))
if a.lamb_like:
    base = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
else:
    base = torch.optim.SGD(model.parameters(), lr=0.01 / (hvd.size() if a.sum_op else 1), momentum=0.9)
opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                               op=hvd.Sum if a.sum_op else hvd.Average)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(opt, root_rank=0)
x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
times = []


def one_step():
    t = time.perf_counter()
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    if a.lamb_like:
        opt.synchronize()
        with torch.no_grad():
            for q in model.parameters():
                if q.dim() > 1:
                    q.grad.mul_(q.norm() / (q.grad.norm() + 1e-6)).clamp_(-1, 1)
        with opt.skip_synchronize():
            opt.step()
        hvd.allreduce(loss.detach(), op=hvd.Average, name="loss")
    else:
        opt.step()
    times.append(time.perf_counter() - t)


if a.elastic:
    @hvd.elastic.run
    def train(state):
        for state.step in range(state.step, a.steps):
            one_step()
            if state.step % 5 == 4:
                state.commit()

    train(hvd.elastic.TorchState(model=model, optimizer=opt, step=0))
else:
    for _ in range(a.steps):
        one_step()
if hvd.rank() == 0:
    print(f"median iteration time: {statistics.median(times[len(times)//2:]) * 1000:.3f} ms")
