"""A Hugging Face Trainer job: a small BERT-style classifier built from a config (nothing downloaded), trained on
synthetic token sequences with the Trainer's own loop, optimizer (AdamW) and DistributedDataParallel wrapping.

A Trainer framework's job, unchanged: the script never builds DDP itself; under torchrun or dprorun the Trainer
sets up the process group (gloo on CPU) and wraps the model. Needs `pip install transformers accelerate`.

    dprorun -np 2 python examples/hf_trainer.py --steps 40
"""
import argparse
import statistics
import tempfile
import time

import torch
from transformers import (BertConfig, BertForSequenceClassification, Trainer, TrainerCallback,
                          TrainingArguments)


class StepTimer(TrainerCallback):
    """The script's own clock: wall time per optimizer step (as the other examples print it)."""

    def __init__(self):
        self.times, self.started = [], None

    def on_step_begin(self, args, state, control, **kwargs):
        self.started = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if self.started is not None:
            self.times.append(time.perf_counter() - self.started)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, count: int, length: int, vocab: int, labels: int, seed: int = 0):
        generator = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (count, length), generator=generator)
        self.labels = torch.randint(0, labels, (count,), generator=generator)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, k):
        return {"input_ids": self.ids[k], "attention_mask": torch.ones_like(self.ids[k]), "labels": self.labels[k]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--bucket-mb", type=float, default=None, help="DDP bucket cap (TrainingArguments."
                                                                      "ddp_bucket_cap_mb; default DDP's own)")
    parser.add_argument("--accumulate", type=int, default=1, help="TrainingArguments.gradient_accumulation_steps")
    parser.add_argument("--eval-every", type=int, default=0, help="evaluate on a held-out set every N steps (0: never)")
    parser.add_argument("--gradient-checkpointing", action="store_true",
                        help="TrainingArguments.gradient_checkpointing: activations recomputed in backward")
    parser.add_argument("--log-every", type=int, default=0, help="log the loss (gathered over ranks) every N steps")
    parser.add_argument("--torch-compile", action="store_true", help="TrainingArguments.torch_compile")
    parser.add_argument("--optim", default="adamw_torch", help="TrainingArguments.optim (adafactor, sgd, ...)")
    args = parser.parse_args()
    # the argument's name in this transformers (`gradient_checkpointing` is deprecated in 5.x)
    fields = getattr(TrainingArguments, "__dataclass_fields__", {})
    checkpointing = "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"
    config = BertConfig(vocab_size=4000, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                        intermediate_size=512, max_position_embeddings=args.seq_len, num_labels=4)
    torch.manual_seed(0)
    model = BertForSequenceClassification(config)
    data = Tokens(args.steps * args.batch_size * 8, args.seq_len, config.vocab_size, config.num_labels)
    timer = StepTimer()
    with tempfile.TemporaryDirectory() as out:
        training = TrainingArguments(output_dir=out, per_device_train_batch_size=args.batch_size,
                                     max_steps=args.steps, learning_rate=1e-4,
                                     logging_strategy="steps" if args.log_every else "no",
                                     logging_steps=args.log_every or 500,
                                     **{checkpointing: args.gradient_checkpointing},
                                     save_strategy="no", report_to=[], use_cpu=True, dataloader_num_workers=0,
                                     ddp_backend="gloo", disable_tqdm=True,
                                     gradient_accumulation_steps=args.accumulate,
                                     eval_strategy="steps" if args.eval_every else "no",
                                     eval_steps=args.eval_every or None, per_device_eval_batch_size=args.batch_size,
                                     ddp_bucket_cap_mb=int(args.bucket_mb) if args.bucket_mb else None,
                                     torch_compile=args.torch_compile, optim=args.optim)
        held_out = Tokens(4 * args.batch_size, args.seq_len, config.vocab_size, config.num_labels, seed=1)
        trainer = Trainer(model=model, args=training, train_dataset=data, callbacks=[timer],
                          eval_dataset=held_out if args.eval_every else None)
        trainer.train()
    tail = timer.times[len(timer.times) // 2:] or timer.times
    if trainer.is_world_process_zero():
        print(f"world size {training.world_size}, {args.steps} steps, "
              f"median iteration time: {statistics.median(tail) * 1000:.3f} ms", flush=True)


if __name__ == "__main__":
    main()
