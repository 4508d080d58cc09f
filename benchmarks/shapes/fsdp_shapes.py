"""FSDP2 (fully_shard) jobs of shapes not tuned for (session 48): `dprorun -np 2 python fsdp_shapes.py --clip`.

--clip: a conv net with BatchNorm, its blocks sharded, AdamW, gradients clipped by their DTensor norm (an all-reduce of
the norms between the backward and the step), a cosine schedule.
--no-reshard: a transformer encoder whose layers are sharded with reshard_after_forward=False (gathered once a step:
no re-gather in the backward), SGD with momentum.
--frozen-embedding: a token model, its frozen embedding table left out of every unit but the root, the rest sharded
per layer, Adam with weight decay.
--bf16-params: an MLP sharded with MixedPrecisionPolicy(param_dtype=bfloat16): its gathers move bf16 bytes.
"""
import argparse, gc, statistics, time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

p = argparse.ArgumentParser()
for flag in ("--clip", "--no-reshard", "--frozen-embedding", "--bf16-params"):
    p.add_argument(flag, action="store_true")
p.add_argument("--steps", type=int, default=60)
a = p.parse_args()
dist.init_process_group("gloo")
torch.manual_seed(0)
schedule = None
if a.clip:
    def block(cin, cout):
        return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(), nn.MaxPool2d(2))

    model = nn.Sequential(block(3, 32), block(32, 64), block(64, 128), nn.Flatten(), nn.Linear(128 * 16, 10))
    for unit in list(model)[:3]:
        fully_shard(unit)
    x, y = torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, a.steps)
elif a.no_reshard:
    layers = [nn.TransformerEncoderLayer(128, 4, 256, batch_first=True) for _ in range(3)]
    model = nn.Sequential(*layers, nn.Flatten(), nn.Linear(128 * 16, 10))
    for layer in layers:
        fully_shard(layer, reshard_after_forward=False)
    x, y = torch.randn(16, 16, 128), torch.randint(0, 10, (16,))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
elif a.frozen_embedding:
    class Tokens(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(8000, 128)
            self.embed.weight.requires_grad_(False)
            self.body = nn.Sequential(*[nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 128))
                                        for _ in range(3)])
            self.head = nn.Linear(128, 10)

        def forward(self, tokens):
            return self.head(self.body(self.embed(tokens)).mean(1))

    model = Tokens()
    for layer in model.body:
        fully_shard(layer)
    x, y = torch.randint(0, 8000, (32, 24)), torch.randint(0, 10, (32,))
    opt = torch.optim.Adam([q for q in model.parameters() if q.requires_grad], lr=1e-3, weight_decay=1e-4)
else:
    model = nn.Sequential(*[nn.Sequential(nn.Linear(512, 512), nn.ReLU()) for _ in range(4)], nn.Linear(512, 10))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for unit in list(model)[:4]:
        fully_shard(unit, mp_policy=policy)
    x, y = torch.randn(64, 512), torch.randint(0, 10, (64,))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
fully_shard(model, **({"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
                      if a.bf16_params else {}))
times = []
for step in range(a.steps):
    t = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(model(x).float(), y).backward()
    if a.clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    if schedule is not None:
        schedule.step()
    times.append(time.perf_counter() - t)
if dist.get_rank() == 0:
    print(f"steps: {a.steps}; median iteration time: {statistics.median(times[len(times) // 2:]) * 1000:.3f} ms")
dist.barrier()
del model, opt
gc.collect()
dist.destroy_process_group()
