"""Shapes not tuned for (session 49): `dprorun -np 2 python session49.py --fsdp-accumulate`.

--fsdp-accumulate: FSDP2 transformer layers, 2 micro-batches a step, the first with gradient sync turned off
(`set_requires_gradient_sync(False)`: no reduce-scatter, gradients kept unsharded), AdamW.
--fsdp-checkpoint: FSDP2 MLP blocks each run under activation checkpointing (non-reentrant): the backward recomputes
each block's forward inside the block's gather.
--fsdp-root-only: one FSDP2 unit, the root (one gather and one reduce-scatter of the whole model a step), Adagrad.
--fsdp-prefetch: FSDP2 blocks with explicit forward and backward prefetching set by the script, RMSprop.
--fsdp-eval: FSDP2 blocks, an evaluation forward under no_grad every 5th step (gathers with no backward), Adam.
--fsdp-gpt2: a transformers GPT-2 (tied embedding and head), each block sharded and the root, AdamW with a linear
warm-up schedule, a dict batch with labels (the model's own loss).
--fsdp-compile: FSDP2 MLP blocks, each block torch.compile'd after it is sharded, SGD.
(ZeroRedundancyOptimizer(overlap_with_ddp=True) was tried: torch refuses it on gloo.)
"""
import argparse, gc, statistics, time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard
from torch.utils.checkpoint import checkpoint

p = argparse.ArgumentParser()
for flag in ("--fsdp-accumulate", "--fsdp-checkpoint", "--fsdp-root-only", "--fsdp-prefetch", "--fsdp-eval",
             "--fsdp-gpt2", "--fsdp-compile"):
    p.add_argument(flag, action="store_true")
p.add_argument("--steps", type=int, default=60)
a = p.parse_args()
dist.init_process_group("gloo")
torch.manual_seed(0)


class Checkpointed(nn.Module):
    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return checkpoint(self.inner, x, use_reentrant=False)


def mlp_blocks(n: int, width: int) -> list:
    return [nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width)) for _ in range(n)]


micro, schedule = 1, None
if a.fsdp_gpt2:
    from transformers import GPT2Config, GPT2LMHeadModel, get_linear_schedule_with_warmup

    model = GPT2LMHeadModel(GPT2Config(vocab_size=2000, n_positions=64, n_embd=128, n_layer=3, n_head=4))
    units = list(model.transformer.h)
    tokens = torch.randint(0, 2000, (8, 64))
    x, y = {"input_ids": tokens, "labels": tokens}, None
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    schedule = get_linear_schedule_with_warmup(opt, 5, a.steps)
elif a.fsdp_accumulate:
    layers = [nn.TransformerEncoderLayer(128, 4, 256, batch_first=True) for _ in range(3)]
    model = nn.Sequential(*layers, nn.Flatten(), nn.Linear(128 * 16, 10))
    units = layers
    x, y = torch.randn(16, 16, 128), torch.randint(0, 10, (16,))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    micro = 2
elif a.fsdp_checkpoint:
    units = [Checkpointed(b) for b in mlp_blocks(4, 512)]
    model = nn.Sequential(*units, nn.Linear(512, 10))
    x, y = torch.randn(64, 512), torch.randint(0, 10, (64,))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
elif a.fsdp_root_only:
    units = []
    model = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(32 * 16, 10))
    x, y = torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,))
    opt = torch.optim.Adagrad(model.parameters(), lr=0.01)
else:
    units = mlp_blocks(4, 448)
    model = nn.Sequential(*units, nn.Linear(448, 10))
    x, y = torch.randn(64, 448), torch.randint(0, 10, (64,))
    opt = (torch.optim.Adam if a.fsdp_eval else torch.optim.RMSprop)(model.parameters(), lr=1e-3)
for unit in units:
    fully_shard(unit)
fully_shard(model)
if a.fsdp_compile:
    for unit in units:
        unit.compile()
if a.fsdp_prefetch:
    for i, unit in enumerate(units[:-1]):
        unit.set_modules_to_forward_prefetch([units[i + 1]])
    for i, unit in enumerate(units[1:], start=1):
        unit.set_modules_to_backward_prefetch([units[i - 1]])

times = []
for step in range(a.steps):
    t = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    for m in range(micro):
        if micro > 1:
            model.set_requires_gradient_sync(m == micro - 1)
        loss = model(**x).loss if a.fsdp_gpt2 else nn.functional.cross_entropy(model(x), y)
        loss.backward()
    opt.step()
    if schedule is not None:
        schedule.step()
    if a.fsdp_eval and step % 5 == 4:
        with torch.no_grad():
            model.eval()
            model(x).argmax(1).eq(y).float().mean()
            model.train()
    times.append(time.perf_counter() - t)
if dist.get_rank() == 0:
    print(f"steps: {a.steps}; median iteration time: {statistics.median(times[len(times) // 2:]) * 1000:.3f} ms")
dist.barrier()
del model, opt
gc.collect()
dist.destroy_process_group()
