"""Shapes not tuned for (session 56), 2 ranks: `dprorun -np 2 python session56.py --rewrap` (or another mode).

--rewrap: DDP fine-tuning in two stages: the head trained for --head-steps with the trunk frozen, then the trunk
unfrozen and the same module wrapped in a new DDP with a new optimizer (Adam) for the remaining steps. DDP buckets
only what requires a gradient when it is built, so the second stage needs the new wrapper.
--frozen-head: the first stage alone for all the steps (6 frozen layers, one 20 KB bucket: the shape whose rank's
heap was found corrupted at the profiler stop; benchmarks/abort_rate.py --launchers frozen-dprorun).
--tf-fit-loop (with --backend tf): tf-keras Model.fit called once per epoch from a Python loop, as scripts do for
per-epoch work of their own (each call runs its epoch's steps; Keras keeps the train function across calls).
Rank 0 prints the median step time of the second half (the second stage's, for --rewrap).
"""
import argparse
import os
import statistics
import time

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=40)
p.add_argument("--rewrap", action="store_true")
p.add_argument("--head-steps", type=int, default=4)
p.add_argument("--frozen-head", action="store_true")
p.add_argument("--tf-fit-loop", action="store_true")
p.add_argument("--steps-per-epoch", type=int, default=8)
a = p.parse_args()


def torch_job() -> None:
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    trunk = nn.Sequential(*[nn.Sequential(nn.Linear(512, 512), nn.ReLU()) for _ in range(6)])
    net = nn.Sequential(trunk, nn.Linear(512, 10))
    for param in trunk.parameters():
        param.requires_grad_(False)
    model = DDP(net)
    opt = torch.optim.SGD([q for q in net.parameters() if q.requires_grad], lr=0.01)
    x, y = torch.randn(128, 512), torch.randint(0, 10, (128,))
    head_steps = a.steps if a.frozen_head else a.head_steps
    times = []
    for step in range(a.steps):
        if step == head_steps:
            for param in trunk.parameters():
                param.requires_grad_(True)
            model = DDP(net)  # the same module again, now with every layer trainable
            opt = torch.optim.Adam(net.parameters(), lr=1e-4)
            times = []
        start = time.perf_counter()
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - start)
    if dist.get_rank() == 0:
        print(f"median iteration time: {1000 * statistics.median(times[len(times) // 2:]):.2f} ms")
    dist.barrier()
    del model
    dist.destroy_process_group()


def tf_job() -> None:
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import numpy as np
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.layers.Input((64,)), tf.keras.layers.Dense(256, activation="relu"),
                                     tf.keras.layers.Dense(256, activation="relu"), tf.keras.layers.Dense(10)])
        model.compile(optimizer="adam", loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    batch = 64
    x = np.random.rand(batch * a.steps_per_epoch, 64).astype("float32")
    y = np.random.randint(0, 10, batch * a.steps_per_epoch)
    times = []
    for _ in range(max(1, a.steps // a.steps_per_epoch)):
        start = time.perf_counter()
        model.fit(x, y, batch_size=batch, epochs=1, verbose=0)
        times.append((time.perf_counter() - start) / a.steps_per_epoch)
    if strategy.cluster_resolver.task_id == 0:
        print(f"median iteration time: {1000 * statistics.median(times[len(times) // 2:]):.2f} ms (an epoch's "
              "fit call over its steps)")


tf_job() if a.tf_fit_loop else torch_job()
