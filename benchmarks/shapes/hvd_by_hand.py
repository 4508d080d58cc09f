"""horovod.torch with the gradients all-reduced by hand (hvd.allreduce_async_ per parameter, synchronize), no
hvd.DistributedOptimizer (session 39). Run with
`dprorun --backend horovod -np 2 python benchmarks/shapes/hvd_by_hand.py`."""
import statistics, time, torch, torch.nn as nn, horovod.torch as hvd
hvd.init(); torch.manual_seed(0); torch.set_num_threads(1)
model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
times = []
for step in range(40):
    t = time.perf_counter()
    opt.zero_grad(); nn.functional.cross_entropy(model(x), y).backward()
    handles = [hvd.allreduce_async_(p.grad, name=f"g{k}", op=hvd.Average) for k, p in enumerate(model.parameters())]
    for h in handles:
        hvd.synchronize(h)
    opt.step()
    times.append(time.perf_counter() - t)
if hvd.rank() == 0:
    print(f"median iteration time: {statistics.median(times[20:]) * 1000:.3f} ms")
