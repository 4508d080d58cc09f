"""Trainer frameworks that start the ranks themselves from one process (session 53): `dprorun python
spawned_trainers.py --lightning-ddp-spawn` (the one process launched spawns the job's ranks).

--lightning-ddp-spawn: Lightning's Trainer(strategy="ddp_spawn", devices=2) on the CPU (torch.multiprocessing's
spawn start method), an MLP with Adam.
--lightning-ddp-notebook: strategy="ddp_notebook" (the fork start method, as in a notebook), SGD with momentum.
--lightning-ddp (session 60): strategy="ddp", Lightning's default launch: the process trains as rank 0 and starts the
script once more as rank 1 (a subprocess with LOCAL_RANK=1), Adam.
--fabric-ddp (session 60): Lightning Fabric(devices=2, strategy="ddp") and fabric.launch() likewise, a conv net with
a loop of the script's own, AdamW.
--ignite-nproc: PyTorch-Ignite's idist.Parallel(backend="gloo", nproc_per_node=2) starting the processes itself,
create_supervised_trainer over a conv net, AdamW.
--accelerate-notebook: Hugging Face Accelerate's notebook_launcher(num_processes=2) (forked processes) around a
loop with accelerator.prepare / accelerator.backward, RMSprop.
"""
import argparse
import statistics
import time

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

p = argparse.ArgumentParser()
for flag in ("--lightning-ddp-spawn", "--lightning-ddp-notebook", "--ignite-nproc", "--accelerate-notebook",
             "--lightning-ddp", "--fabric-ddp"):
    p.add_argument(flag, action="store_true")
p.add_argument("--steps", type=int, default=60)
a = p.parse_args()


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 512), nn.ReLU(), nn.Linear(512, 10))


def conv() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(32, 64, 3, padding=1),
                         nn.ReLU(), nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(1024, 256), nn.ReLU(),
                         nn.Linear(256, 10))


def lightning_module(optimizer: str):
    """A LightningModule class defined at module level (ddp_spawn pickles the module by its class's name)."""
    global LitMLP
    import lightning as L

    class LitMLP(L.LightningModule):
        def __init__(self, optimizer: str):
            super().__init__()
            self.net = mlp()
            self.optimizer = optimizer
            self.times: list[float] = []
            self.started = 0.0

        def on_train_batch_start(self, batch, batch_idx):
            self.started = time.perf_counter()

        def on_train_batch_end(self, outputs, batch, batch_idx):
            self.times.append(time.perf_counter() - self.started)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            if self.optimizer == "adam":
                return torch.optim.Adam(self.parameters(), lr=1e-3)
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

        def on_train_end(self):
            if self.global_rank == 0:
                print(f"median step {1000 * statistics.median(self.times[len(self.times) // 2:]):.2f} ms")

    return LitMLP(optimizer)


if a.lightning_ddp_spawn or a.lightning_ddp_notebook:
    lightning_module("adam")  # defines LitMLP here too when the spawned processes import this file


def lightning(strategy: str, optimizer: str) -> None:
    import lightning as L

    n = 64 * a.steps * 2
    loader = DataLoader(TensorDataset(torch.randn(n, 256), torch.randint(0, 10, (n,))), batch_size=64)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=a.steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(lightning_module(optimizer), loader)


def ignite_training(local_rank: int) -> None:
    import ignite.distributed as idist
    from ignite.engine import Events, create_supervised_trainer

    torch.manual_seed(0)
    torch.set_num_threads(1)
    n = 32 * a.steps * idist.get_world_size()
    data = TensorDataset(torch.randn(n, 3, 32, 32), torch.randint(0, 10, (n,)))
    loader = idist.auto_dataloader(data, batch_size=32 * idist.get_world_size(), shuffle=True)
    model = idist.auto_model(conv())
    opt = idist.auto_optim(torch.optim.AdamW(model.parameters(), lr=1e-3))
    trainer = create_supervised_trainer(model, opt, nn.CrossEntropyLoss())
    times: list[float] = []
    marks = {"t": 0.0}
    trainer.add_event_handler(Events.ITERATION_STARTED, lambda _: marks.update(t=time.perf_counter()))
    trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda _: times.append(time.perf_counter() - marks["t"]))
    trainer.run(loader, max_epochs=1, epoch_length=a.steps)
    if idist.get_rank() == 0:
        print(f"median step {1000 * statistics.median(times[len(times) // 2:]):.2f} ms")


def timed_loop(loader, model, optimizer, backward, main: bool) -> None:
    """The loop of a script that steps its own optimizer through a framework's backward (Fabric's, Accelerate's);
    the main process prints the median step of the second half."""
    times = []
    for x, y in loader:
        start = time.perf_counter()
        optimizer.zero_grad()
        backward(nn.functional.cross_entropy(model(x), y))
        optimizer.step()
        times.append(time.perf_counter() - start)
    if main:
        print(f"median step {1000 * statistics.median(times[len(times) // 2:]):.2f} ms")


def fabric_loop() -> None:
    import lightning as L

    fabric = L.Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
    torch.manual_seed(0)
    model = conv()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = fabric.setup(model, optimizer)
    n = 32 * a.steps * 2
    loader = fabric.setup_dataloaders(DataLoader(TensorDataset(torch.randn(n, 3, 32, 32), torch.randint(0, 10, (n,))),
                                                 batch_size=32))
    timed_loop(loader, model, optimizer, fabric.backward, fabric.global_rank == 0)


def accelerate_loop() -> None:
    from accelerate import Accelerator

    torch.set_num_threads(1)
    accelerator = Accelerator(cpu=True)
    model = mlp()
    optimizer = torch.optim.RMSprop(model.parameters(), lr=1e-3)
    n = 64 * a.steps * 2  # sharded over the 2 processes by accelerator.prepare
    loader = DataLoader(TensorDataset(torch.randn(n, 256), torch.randint(0, 10, (n,))), batch_size=64)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    timed_loop(loader, model, optimizer, accelerator.backward, accelerator.is_main_process)


if __name__ == "__main__":
    torch.set_num_threads(1)
    if a.lightning_ddp_spawn:
        lightning("ddp_spawn", "adam")
    elif a.lightning_ddp_notebook:
        lightning("ddp_notebook", "sgd")
    elif a.lightning_ddp:
        lightning("ddp", "adam")
    elif a.fabric_ddp:
        fabric_loop()
    elif a.ignite_nproc:
        import ignite.distributed as idist

        with idist.Parallel(backend="gloo", nproc_per_node=2) as parallel:
            parallel.run(ignite_training)
    elif a.accelerate_notebook:
        from accelerate import notebook_launcher

        notebook_launcher(accelerate_loop, num_processes=2)
