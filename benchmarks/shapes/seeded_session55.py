"""Seeded training scripts for benchmarks/seeded_identity.py: `python seeded_session55.py MODE OUT_DIR`.

Each seeds its framework, trains a small dropout model for 40 steps and writes, per rank, the sum of its losses, a
hash of its final weights and the next number its random generators draw into OUT_DIR/rank<r>.txt. The same file
from a plain launch and from dprorun says whether dprorun changed the training.
MODE: ddp, ddp-view, ddp-static, ddp-unused, ddp-accum, ddp-bf16 (torch DDP variants), lightning, horovod, tf, mxnet.
"""
import hashlib
import os
import random
import sys

MODE, OUT = sys.argv[1], sys.argv[2]
STEPS = 40


def write(rank: int, losses: list, weights: list, draws: list) -> None:
    digest = hashlib.sha256(b"".join(weights)).hexdigest()[:16]
    with open(os.path.join(OUT, f"rank{rank}.txt"), "w") as out:
        print(round(sum(losses), 6), digest, *draws, file=out)


def torch_ddp() -> None:
    import torch
    import torch.distributed as dist
    import torch.nn as nn

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    random.seed(0)
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.BatchNorm1d(128), nn.Dropout(0.2),
                                      nn.Linear(128, 10))
            self.unused = nn.Linear(4, 4)  # no step uses it (DDP's find_unused_parameters, static_graph)

        def forward(self, x):
            return self.body(x)

    net = Net().to(torch.bfloat16) if MODE == "ddp-bf16" else Net()
    options = {"ddp-view": {"gradient_as_bucket_view": True}, "ddp-static": {"static_graph": True}}
    ddp = nn.parallel.DistributedDataParallel(net, bucket_cap_mb=0.01, find_unused_parameters=MODE != "ddp-static",
                                              **options.get(MODE, {}))
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    losses = []
    for _ in range(STEPS):
        x, y = torch.randn(64, 32), torch.randint(0, 10, (64,))
        x = x.to(torch.bfloat16) if MODE == "ddp-bf16" else x
        opt.zero_grad()
        if MODE == "ddp-accum":
            with ddp.no_sync():
                nn.functional.cross_entropy(ddp(x[:32]), y[:32]).backward()
            x, y = x[32:], y[32:]
        loss = nn.functional.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    write(dist.get_rank(), losses, [p.detach().float().numpy().tobytes() for p in net.parameters()],
          [torch.rand(1).item(), random.random()])
    del ddp, opt  # the group's last holders, before it is destroyed
    dist.destroy_process_group()


def lightning() -> None:
    import lightning as L
    import torch
    import torch.nn as nn
    from torch.utils.data import DataLoader, TensorDataset

    L.seed_everything(0)

    class Model(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Dropout(0.3), nn.Linear(128, 10))
            self.losses = []

        def training_step(self, batch, index):
            loss = nn.functional.cross_entropy(self.net(batch[0]), batch[1])
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    data = TensorDataset(torch.randn(64 * STEPS, 32), torch.randint(0, 10, (64 * STEPS,)))
    model = Model()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, DataLoader(data, batch_size=32, shuffle=True))
    write(trainer.global_rank, model.losses, [p.detach().numpy().tobytes() for p in model.parameters()],
          [torch.rand(1).item(), random.random()])


def horovod() -> None:
    import horovod.torch as hvd
    import numpy as np
    import torch
    import torch.nn as nn

    hvd.init()
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    net = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Dropout(0.3), nn.Linear(128, 10))
    opt = hvd.DistributedOptimizer(torch.optim.Adam(net.parameters(), lr=1e-3), named_parameters=net.named_parameters())
    hvd.broadcast_parameters(net.state_dict(), root_rank=0)
    losses = []
    for _ in range(STEPS):
        x, y = torch.randn(64, 32), torch.randint(0, 10, (64,))
        loss = nn.functional.cross_entropy(net(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    write(hvd.rank(), losses, [p.detach().numpy().tobytes() for p in net.parameters()],
          [torch.rand(1).item(), random.random(), float(np.random.rand())])


def tensorflow() -> None:
    import json

    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    import numpy as np
    import tensorflow as tf

    tf.keras.utils.set_random_seed(0)
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.Input((32,)), tf.keras.layers.Dense(128, activation="relu"),
                                     tf.keras.layers.Dropout(0.3), tf.keras.layers.Dense(10)])
        model.compile(optimizer="adam", loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = np.random.randn(64 * STEPS, 32).astype("float32"), np.random.randint(0, 10, 64 * STEPS)
    history = model.fit(x, y, batch_size=64, epochs=1, verbose=0, shuffle=True)
    write(json.loads(os.environ["TF_CONFIG"])["task"]["index"], history.history["loss"],
          [w.tobytes() for w in model.get_weights()], [float(np.random.rand()), float(tf.random.uniform(()))])


def mxnet() -> None:
    import mxnet as mx
    import numpy as np
    from mxnet import autograd, gluon, nd

    mx.random.seed(0)
    np.random.seed(0)
    kv = mx.kv.create("dist_sync")
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(128, activation="relu"), gluon.nn.Dropout(0.3), gluon.nn.Dense(10))
    net.initialize(mx.init.Xavier())
    trainer = gluon.Trainer(net.collect_params(), "adam", {"learning_rate": 1e-3}, kvstore=kv)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    losses = []
    for _ in range(STEPS):
        x, y = nd.array(np.random.randn(32, 64)), nd.array(np.random.randint(0, 10, 32))
        with autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        trainer.step(32)
        losses.append(float(loss.mean().asscalar()))
    write(kv.rank, losses, [p.data().asnumpy().tobytes() for p in net.collect_params().values()],
          [float(nd.random.uniform(shape=(1,)).asscalar()), float(np.random.rand())])


if MODE.startswith("ddp"):
    torch_ddp()
else:
    {"lightning": lightning, "horovod": horovod, "tf": tensorflow, "mxnet": mxnet}[MODE]()
