"""DDP scripts of shapes not tuned for (session 39), one flag each; run with `dprorun -np 2 python ddp_session39.py`.

--parametrized: layers under torch.nn.utils.parametrizations (weight_norm, spectral_norm: the parameters DDP sees
are `parametrizations.weight.original0/1`, the weight recomputed each forward, spectral_norm's power iteration in
buffers). --dcp-every N: torch.distributed.checkpoint.save of the model and optimizer every N steps (its planning
gathers every rank's plan and ends in a barrier). --attention: a small transformer block built by hand on
scaled_dot_product_attention with a causal mask, AdamW(fused=True) and a warm-up LambdaLR. --dict-batches: the
model takes and returns dicts (a batch of named tensors; the loss from a dict entry), as Trainer-style models do.
--set-to-none-false: zero_grad(set_to_none=False) and SGD with foreach=False, gradients kept between steps.
--grow-batch-at N: the batch grows from 64 to 256 at step N (progressive batch sizes: the job's speed changes).
--torchscript: DDP of a torch.jit.script'ed model (TorchScript modules take no forward hooks). --dataclass-output:
the model returns a dataclass of its logits and features."""
import argparse, dataclasses, statistics, tempfile, time
import torch, torch.distributed as dist, torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser(); p.add_argument("--steps", type=int, default=40)
for flag in ("--parametrized", "--attention", "--dict-batches", "--set-to-none-false", "--torchscript",
             "--dataclass-output"):
    p.add_argument(flag, action="store_true")
p.add_argument("--dcp-every", type=int, default=0)
p.add_argument("--grow-batch-at", type=int, default=-1)
a = p.parse_args()
dist.init_process_group("gloo"); torch.manual_seed(0); torch.set_num_threads(1)
rank = dist.get_rank()


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads, self.norm1, self.norm2 = heads, nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(att)
        return x + self.mlp(self.norm2(x))


@dataclasses.dataclass
class Output:
    logits: torch.Tensor
    features: torch.Tensor


class DictModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU())
        self.head = nn.Linear(1024, 10)

    def forward(self, batch):
        logits = self.head(self.body(batch["features"]))
        return {"logits": logits, "loss": F.cross_entropy(logits, batch["labels"])}


class DataclassModel(DictModel):  # the same layers, a dataclass out
    def forward(self, x):
        features = self.body(x)
        return Output(self.head(features), features)


if a.attention:
    net = nn.Sequential(nn.Embedding(1000, 128), Block(128, 4), Block(128, 4), nn.Linear(128, 1000))
    x, y = torch.randint(0, 1000, (16, 64)), torch.randint(0, 1000, (16, 64))
elif a.dict_batches or a.dataclass_output:
    net = DataclassModel() if a.dataclass_output else DictModel()
    x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
else:
    net = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
    x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
if a.parametrized:
    from torch.nn.utils.parametrizations import spectral_norm, weight_norm
    net[0], net[2] = weight_norm(net[0]), spectral_norm(net[2])
model = nn.parallel.DistributedDataParallel(torch.jit.script(net) if a.torchscript else net)
if a.attention:
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
elif a.set_to_none_false:
    opt, sched = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, foreach=False), None
else:
    opt, sched = torch.optim.Adam(model.parameters(), lr=1e-3), None
checkpoints = tempfile.mkdtemp() if rank == 0 else None


def loss_of_step():
    if a.attention:
        return F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    if a.dict_batches:
        return model({"features": x, "labels": y})["loss"]
    if a.dataclass_output:
        return F.cross_entropy(model(x).logits, y)
    return F.cross_entropy(model(x), y)


times = []
for step in range(a.steps):
    if step == a.grow_batch_at:
        x, y = torch.randn(256, 256), torch.randint(0, 10, (256,))
    t = time.perf_counter()
    opt.zero_grad(set_to_none=not a.set_to_none_false)
    loss_of_step().backward()
    opt.step()
    if sched is not None:
        sched.step()
    if a.dcp_every and step % a.dcp_every == a.dcp_every - 1:
        import torch.distributed.checkpoint as dcp

        folder = [checkpoints]
        dist.broadcast_object_list(folder)
        dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=f"{folder[0]}/step{step}")
    times.append(time.perf_counter() - t)
if rank == 0:
    print(f"median iteration time: {statistics.median(times[len(times)//2:]) * 1000:.3f} ms")
dist.destroy_process_group()
