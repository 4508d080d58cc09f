"""Horovod (horovod.torch) shapes of session 38: --allgather-loss (CLIP-style: every rank's embeddings gathered
with hvd.allgather, which autograd runs back through, inside the loss), --sparse-embedding (an nn.Embedding with
sparse gradients beside dense layers: Horovod all-gathers the sparse ones), --sparse-as-dense (the same model with
DistributedOptimizer(sparse_as_dense=True)), --predivide (gradient_predivide_factor=2: half the averaging before
the sum, half after)."""
import argparse, statistics, time
import torch, torch.nn as nn
import horovod.torch as hvd
p = argparse.ArgumentParser(); p.add_argument("--steps", type=int, default=40)
for flag in ("--allgather-loss", "--sparse-embedding", "--sparse-as-dense", "--predivide"):
    p.add_argument(flag, action="store_true")
a = p.parse_args()
hvd.init(); torch.manual_seed(0); torch.set_num_threads(1)
sparse = a.sparse_embedding or a.sparse_as_dense


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.table = nn.Embedding(50_000, 64, sparse=True) if sparse else None
        self.body = nn.Sequential(nn.Linear(256 + (64 if sparse else 0), 1024), nn.ReLU(),
                                  nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 128))

    def forward(self, x, ids):
        if self.table is not None:
            x = torch.cat([x, self.table(ids).mean(1)], 1)
        return self.body(x)


model = Net()
base = torch.optim.SGD(model.parameters(), lr=0.01) if sparse else torch.optim.Adam(model.parameters(), lr=1e-3)
opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(), sparse_as_dense=a.sparse_as_dense,
                               gradient_predivide_factor=2.0 if a.predivide else 1.0)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(opt, root_rank=0)
x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
times = []
for step in range(a.steps):
    t = time.perf_counter()
    ids = torch.randint(0, 50_000, (64, 8))
    opt.zero_grad()
    out = model(x, ids)
    if a.allgather_loss:
        z = nn.functional.normalize(out, dim=1)
        everyone = hvd.allgather(z, name="features")
        loss = nn.functional.cross_entropy(z @ everyone.t() / 0.1, torch.arange(64) + 64 * hvd.rank())
    else:
        loss = nn.functional.cross_entropy(out[:, :10], y)
    loss.backward()
    opt.step()
    times.append(time.perf_counter() - t)
if hvd.rank() == 0:
    print(f"median iteration time: {statistics.median(times[len(times)//2:]) * 1000:.3f} ms")
