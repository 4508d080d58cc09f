"""Trainer frameworks' own loops over DDP, the script never building DDP itself: --framework accelerate (an
Accelerator prepares model, optimizer, loader and scheduler; accelerator.backward; --accum N uses its
gradient_accumulation_steps and accumulate() context) or lightning (a LightningModule fitted by lightning's Trainer
with strategy="ddp" on CPU, max_steps; --val a validation pass every 10 steps). --bf16: their bf16 mixed
precision. A conv trunk with an embedding-fed head, Adam. Needs `pip install accelerate` / `pip install lightning`
(benchmarks/unseen_shapes.py skips a job whose framework is missing)."""
import argparse, statistics, time
import torch, torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset
p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=40); p.add_argument("--framework", default="accelerate")
p.add_argument("--accum", type=int, default=1)
p.add_argument("--bf16", action="store_true", help="bf16 mixed precision (Accelerate's, Lightning's own)")
p.add_argument("--val", action="store_true", help="lightning: a validation pass every 10 steps")
p.add_argument("--static-graph", action="store_true", help="lightning: DDPStrategy(static_graph=True, "
               "gradient_as_bucket_view=True)")
p.add_argument("--clip", action="store_true", help="lightning: gradients clipped by norm (gradient_clip_val=1.0)")
a = p.parse_args()
torch.manual_seed(0); torch.set_num_threads(1)


class Net(nn.Module):
    def __init__(s):
        super().__init__()
        s.trunk = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                                nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4), nn.Flatten())
        s.emb = nn.Embedding(5000, 32)
        s.head = nn.Sequential(nn.Linear(512 + 32, 768), nn.ReLU(), nn.Linear(768, 10))

    def forward(s, x, ids):
        return s.head(torch.cat([s.trunk(x), s.emb(ids).mean(1)], dim=1))


def dataset(world: int) -> TensorDataset:
    n = 16 * a.steps * a.accum * world
    return TensorDataset(torch.randn(n, 3, 32, 32), torch.randint(0, 5000, (n, 6)), torch.randint(0, 10, (n,)))


def report(times: list, rank: int) -> None:
    if rank == 0 and times:
        tail = times[len(times) // 2:]
        print(f"median iteration time: {statistics.median(tail) * 1000:.3f} ms")


def with_accelerate() -> None:
    from accelerate import Accelerator

    acc = Accelerator(cpu=True, gradient_accumulation_steps=a.accum, mixed_precision="bf16" if a.bf16 else "no")
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loader = DataLoader(dataset(acc.num_processes), batch_size=16, shuffle=True)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.9)
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    times, t = [], time.perf_counter()
    for k, (x, ids, y) in enumerate(loader):
        with acc.accumulate(model):
            loss = nn.functional.cross_entropy(model(x, ids), y)
            acc.backward(loss)
            opt.step(); sched.step(); opt.zero_grad()
        if acc.sync_gradients:
            times.append(time.perf_counter() - t)
            t = time.perf_counter()
        if len(times) == a.steps:
            break
    report(times, acc.process_index)
    acc.end_training()


def with_lightning() -> None:
    import lightning as L

    class Module(L.LightningModule):
        def __init__(s):
            super().__init__()
            s.net, s.times, s.t = Net(), [], None

        def training_step(s, batch, k):
            x, ids, y = batch
            loss = nn.functional.cross_entropy(s.net(x, ids), y)
            s.log("loss", loss, sync_dist=False)
            return loss

        def on_train_batch_start(s, batch, k):
            s.t = time.perf_counter()

        def on_train_batch_end(s, out, batch, k):
            s.times.append(time.perf_counter() - s.t)

        def validation_step(s, batch, k):
            x, ids, y = batch
            s.log("val_loss", nn.functional.cross_entropy(s.net(x, ids), y), sync_dist=True)

        def configure_optimizers(s):
            return torch.optim.Adam(s.parameters(), lr=1e-3)

    import os
    world = int(os.environ.get("WORLD_SIZE", "1"))
    module = Module()
    from lightning.pytorch.strategies import DDPStrategy

    strategy = DDPStrategy(static_graph=True, gradient_as_bucket_view=True) if a.static_graph else "ddp"
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=a.steps, logger=False,
                        gradient_clip_val=1.0 if a.clip else None,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        accumulate_grad_batches=a.accum, precision="bf16-mixed" if a.bf16 else "32-true",
                        val_check_interval=10 if a.val else None, limit_val_batches=4 if a.val else 0,
                        num_sanity_val_steps=0)
    val = DataLoader(dataset(world), batch_size=16) if a.val else None
    trainer.fit(module, DataLoader(dataset(world), batch_size=16, shuffle=True), val)
    report(module.times, trainer.global_rank)


with_accelerate() if a.framework == "accelerate" else with_lightning()
