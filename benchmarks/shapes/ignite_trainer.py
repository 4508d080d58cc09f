"""PyTorch-Ignite's trainer (a Trainer framework): idist.auto_model wraps the model in DDP, idist.auto_dataloader
shards the data, create_supervised_trainer runs the loop as an Engine; --parallel runs it under ignite's own
idist.Parallel context (which, under a launcher that set the ranks' environment, starts no processes of its own).
Run with `dprorun -np 2 python benchmarks/shapes/ignite_trainer.py` (needs `pip install pytorch-ignite`)."""
import argparse, statistics, time
import torch, torch.nn as nn
import ignite.distributed as idist
from ignite.engine import Events, create_supervised_trainer
from torch.utils.data import TensorDataset

p = argparse.ArgumentParser(); p.add_argument("--steps", type=int, default=40)
p.add_argument("--parallel", action="store_true"); a = p.parse_args()


def training(local_rank: int) -> None:
    torch.manual_seed(0); torch.set_num_threads(1)
    n = 64 * a.steps * idist.get_world_size()
    data = TensorDataset(torch.randn(n, 3, 32, 32), torch.randint(0, 10, (n,)))
    loader = idist.auto_dataloader(data, batch_size=64 * idist.get_world_size(), shuffle=True)
    model = idist.auto_model(nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                                           nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4),
                                           nn.Flatten(), nn.Linear(1024, 256), nn.ReLU(), nn.Linear(256, 10)))
    opt = idist.auto_optim(torch.optim.Adam(model.parameters(), lr=1e-3))
    trainer = create_supervised_trainer(model, opt, nn.CrossEntropyLoss())
    times: list[float] = []
    marks = {"t": 0.0}
    trainer.add_event_handler(Events.ITERATION_STARTED, lambda _: marks.update(t=time.perf_counter()))
    trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda _: times.append(time.perf_counter() - marks["t"]))
    trainer.run(loader, max_epochs=1, epoch_length=a.steps)
    if idist.get_rank() == 0:
        print(f"median iteration time: {statistics.median(times[len(times) // 2:]) * 1000:.3f} ms")


if a.parallel:
    with idist.Parallel(backend="gloo") as parallel:
        parallel.run(training)
else:
    idist.initialize("gloo")
    training(idist.get_local_rank())
    idist.finalize()
