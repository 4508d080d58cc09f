"""A DDP model called with keywords only (forward(*, features, labels)), as Hugging Face models are (session 39). Run
with `dprorun -np 2 --measure-variants python benchmarks/shapes/ddp_keyword_model.py`."""
import torch, torch.distributed as dist, torch.nn as nn
dist.init_process_group("gloo"); torch.manual_seed(0); torch.set_num_threads(1)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 10))

    def forward(self, *, features, labels):
        return nn.functional.cross_entropy(self.body(features), labels)


model = nn.parallel.DistributedDataParallel(Net())
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
for step in range(40):
    opt.zero_grad(); model(features=x, labels=y).backward(); opt.step()
