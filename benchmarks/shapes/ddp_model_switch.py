"""Models trained one after another in one job (folds of a cross-validation, pre-training then fine-tuning, a
learning-rate finder's throwaway model first): --models M models of --width W (4 Linear layers), --first-steps
for the first, --steps for each of the others. Rank 0 prints its RSS after each model (after gc.collect())."""
import argparse, gc
import psutil, torch, torch.distributed as dist, torch.nn as nn
p = argparse.ArgumentParser()
p.add_argument("--models", type=int, default=4)
p.add_argument("--width", type=int, default=1024)
p.add_argument("--steps", type=int, default=12)
p.add_argument("--first-steps", type=int, default=0)
a = p.parse_args()
dist.init_process_group("gloo"); torch.set_num_threads(1)
rank = dist.get_rank()
for index in range(a.models):
    torch.manual_seed(index)
    layers = [m for _ in range(4) for m in (nn.Linear(a.width, a.width), nn.ReLU())]
    model = nn.parallel.DistributedDataParallel(nn.Sequential(*layers, nn.Linear(a.width, 10)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    for step in range(a.first_steps if index == 0 and a.first_steps else a.steps):
        loss = nn.functional.cross_entropy(model(torch.randn(64, a.width)), torch.randint(0, 10, (64,)))
        opt.zero_grad(); loss.backward(); opt.step()
    del model, opt
    gc.collect()
    if rank == 0:
        print(f"model {index} rss_mib {psutil.Process().memory_info().rss / 2**20:.1f}", flush=True)
dist.destroy_process_group()
