"""A Hugging Face transformers causal LM in a plain DDP loop (session 40): GPT-2 of a small config (its LM head tied
to the token embedding), called with keywords (`model(**batch)`, labels inside: the loss comes back in a ModelOutput),
AdamW with the library's linear warm-up schedule, gradient clipping. --checkpointing: the model's own gradient
checkpointing (each block's forward run again in the backward). --bf16: the forward under CPU autocast bfloat16.
`dprorun -np 2 python ddp_hf_loop.py [--checkpointing] [--bf16]`."""
import argparse, statistics, time

import torch, torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel, get_linear_schedule_with_warmup

p = argparse.ArgumentParser(); p.add_argument("--steps", type=int, default=40)
p.add_argument("--checkpointing", action="store_true"); p.add_argument("--bf16", action="store_true")
a = p.parse_args()
dist.init_process_group("gloo"); torch.manual_seed(0); torch.set_num_threads(1)
config = GPT2Config(vocab_size=2000, n_positions=128, n_embd=128, n_layer=3, n_head=4)
net = GPT2LMHeadModel(config)
if a.checkpointing:
    net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
model = torch.nn.parallel.DistributedDataParallel(net)
opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.01)
sched = get_linear_schedule_with_warmup(opt, num_warmup_steps=5, num_training_steps=a.steps)
g = torch.Generator().manual_seed(dist.get_rank())
times = []
for step in range(a.steps):
    ids = torch.randint(0, config.vocab_size, (8, 64), generator=g)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    t = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.bf16):
        loss = model(**batch).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
    times.append(time.perf_counter() - t)
if dist.get_rank() == 0:
    print(f"median iteration time: {statistics.median(times[len(times)//2:]) * 1000:.3f} ms")
dist.destroy_process_group()
