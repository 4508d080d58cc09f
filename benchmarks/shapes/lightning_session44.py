"""Lightning shapes not tuned for (session 44), one flag each; run with `dprorun -np 2 python
lightning_session44.py`. --fabric: Lightning Fabric's own loop (fabric.setup, fabric.backward; the script writes the
loop, Fabric builds DDP; also as `dprorun fabric run --accelerator cpu --devices 2 lightning_session44.py --fabric`). --manual-one: manual optimization with one optimizer, a scheduler stepped by hand and
gradients clipped by Lightning's clip_gradients. --sync-log: automatic optimization logging its loss with
sync_dist=True (an all-reduce of the script's inside every training step)."""
import argparse, os, statistics, time
import torch, torch.nn as nn
import lightning as L
from torch.utils.data import DataLoader, TensorDataset

p = argparse.ArgumentParser(); p.add_argument("--steps", type=int, default=40)
for flag in ("--fabric", "--manual-one", "--sync-log"):
    p.add_argument(flag, action="store_true")
a = p.parse_args()
torch.manual_seed(0); torch.set_num_threads(1)


def net() -> nn.Module:
    return nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 512), nn.ReLU(), nn.Linear(512, 10))


def data() -> DataLoader:
    n = 64 * a.steps * 2
    return DataLoader(TensorDataset(torch.randn(n, 256), torch.randint(0, 10, (n,))), batch_size=64)


def report(times: list, rank: int) -> None:
    if rank == 0 and times:
        print(f"median iteration time: {statistics.median(times[len(times) // 2:]) * 1000:.3f} ms")


class Module(L.LightningModule):
    def __init__(s):
        super().__init__()
        s.net, s.times, s.t = net(), [], None
        s.automatic_optimization = not a.manual_one

    def training_step(s, batch, k):
        x, y = batch
        loss = nn.functional.cross_entropy(s.net(x), y)
        if a.sync_log:
            s.log("loss", loss, sync_dist=True)
        if not a.manual_one:
            return loss
        opt, sched = s.optimizers(), s.lr_schedulers()
        opt.zero_grad()
        s.manual_backward(loss)
        s.clip_gradients(opt, gradient_clip_val=1.0, gradient_clip_algorithm="norm")
        opt.step()
        sched.step()
        return None

    def on_train_batch_start(s, batch, k):
        s.t = time.perf_counter()

    def on_train_batch_end(s, out, batch, k):
        s.times.append(time.perf_counter() - s.t)

    def configure_optimizers(s):
        opt = torch.optim.AdamW(s.parameters(), lr=1e-3)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.9)]


def with_fabric() -> None:
    if os.environ.get("LT_CLI_USED"):  # `fabric run ...` made the processes and set the Fabric's settings
        fabric = L.Fabric()
    else:
        fabric = L.Fabric(accelerator="cpu", devices=int(os.environ.get("WORLD_SIZE", "1")), strategy="ddp")
        fabric.launch()
    model, opt = net(), None
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = fabric.setup(model, opt)
    loader = fabric.setup_dataloaders(data())
    times = []
    for k, (x, y) in enumerate(loader):
        t = time.perf_counter()
        opt.zero_grad()
        fabric.backward(nn.functional.cross_entropy(model(x), y))
        opt.step()
        times.append(time.perf_counter() - t)
        if k + 1 == a.steps:
            break
    report(times, fabric.global_rank)


def with_trainer() -> None:
    module = Module()
    trainer = L.Trainer(accelerator="cpu", devices=int(os.environ.get("WORLD_SIZE", "1")),
                        strategy="ddp", max_steps=a.steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, data())
    report(module.times, trainer.global_rank)


with_fabric() if a.fabric else with_trainer()
