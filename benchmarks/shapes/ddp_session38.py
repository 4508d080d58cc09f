"""DDP scripts of shapes not tuned for (session 38), one flag each; run with `dprorun -np 2 python ddp_session38.py`.

--two-views: SimCLR-style, the DDP module called twice a step (two augmented views), one backward through both.
--clip-gather: CLIP-style, the other ranks' features gathered inside the loss with the differentiable all_gather
(torch.distributed.nn), so collectives run in the forward and in the backward. --moe: a mixture-of-experts layer,
tokens routed to the rank owning their expert with all_to_all_single (differentiable), the experts' weights kept out
of DDP (`_set_params_and_buffers_to_ignore_for_model`) and the dense ones all-reduced. --rank0-logging: rank 0
alone writes a metrics line and a small state snapshot every step (the others wait for it in the next all-reduce).
--barrier-each-step: dist.barrier() before each step's timer, as benchmarking loops do. --straggler: rank 1 alone
waits 8 ms for its input every step (a slow loader on one node). --accumulate-syncing N: gradient accumulation over
N micro-batches without no_sync (DDP all-reduces every micro-batch's gradients, the optimizer steps every N).
--gradient-penalty: a WGAN-GP critic step (DDP critic; the penalty's input gradient by torch.autograd.grad with
create_graph=True, then one backward through it) and a generator step every 5 critic steps. --compile-inside: DDP
of a torch.compile'd module (dynamo splits the graph at DDP's buckets)."""
import argparse, json, os, statistics, tempfile, time
import torch, torch.distributed as dist, torch.nn as nn
import torch.distributed.nn.functional as dnnf

p = argparse.ArgumentParser(); p.add_argument("--steps", type=int, default=40)
for flag in ("--two-views", "--clip-gather", "--moe", "--rank0-logging", "--barrier-each-step", "--straggler",
             "--gradient-penalty", "--compile-inside"):
    p.add_argument(flag, action="store_true")
p.add_argument("--accumulate-syncing", type=int, default=1)
a = p.parse_args()
dist.init_process_group("gloo"); torch.manual_seed(0); torch.set_num_threads(1)
rank, world = dist.get_rank(), dist.get_world_size()


class MoE(nn.Module):
    """A dense gate, one expert per rank: each rank's tokens go to their expert's rank and come back."""

    def __init__(self, dim: int):
        super().__init__()
        self.gate = nn.Linear(dim, world)
        self.expert = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x):
        order = self.gate(x).argmax(1).argsort()  # tokens grouped by expert, equal shares (a capacity of n/world)
        routed = x[order]
        sent = dnnf.all_to_all_single(torch.empty_like(routed), routed)  # each rank gets its expert's share
        done = dnnf.all_to_all_single(torch.empty_like(sent), self.expert(sent))
        out = torch.empty_like(done)
        out[order] = done
        return x + out * torch.sigmoid(self.gate(x)).mean(1, keepdim=True)


if a.moe:
    net = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), MoE(512), nn.Linear(512, 10))
    ignored = [f"2.expert.{name}" for name, _ in net[2].expert.named_parameters()]
    nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(net, ignored)
else:
    net = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 256))
if a.gradient_penalty:  # the critic: 256 -> 1; the generator: 64 -> 256
    net = nn.Sequential(nn.Linear(256, 1024), nn.LeakyReLU(0.2), nn.Linear(1024, 1024), nn.LeakyReLU(0.2),
                        nn.Linear(1024, 1))
    generator = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 256)))
    g_opt = torch.optim.Adam(generator.parameters(), lr=1e-4, betas=(0.0, 0.9))
model = nn.parallel.DistributedDataParallel(torch.compile(net) if a.compile_inside else net)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
log_dir = tempfile.mkdtemp()


def critic_loss():
    fake = generator(torch.randn(len(x), 64)).detach()
    mix = torch.rand(len(x), 1)
    blend = (mix * x + (1 - mix) * fake).requires_grad_(True)
    grad, = torch.autograd.grad(model(blend).sum(), blend, create_graph=True)
    penalty = ((grad.norm(dim=1) - 1) ** 2).mean()
    return model(fake).mean() - model(x).mean() + 10 * penalty


def loss_of_step():
    if a.gradient_penalty:
        return critic_loss()
    if a.two_views:  # two noisy views of the batch, their embeddings pulled together (NT-Xent in short)
        z1 = nn.functional.normalize(model(x + 0.1 * torch.randn_like(x)), dim=1)
        z2 = nn.functional.normalize(model(x + 0.1 * torch.randn_like(x)), dim=1)
        logits = z1 @ z2.t() / 0.1
        return nn.functional.cross_entropy(logits, torch.arange(len(x)))
    if a.clip_gather:  # every rank's embeddings as negatives, gradients flowing back to their ranks
        z = nn.functional.normalize(model(x), dim=1)
        everyone = torch.cat(dnnf.all_gather(z), 0)
        logits = z @ everyone.t() / 0.1
        return nn.functional.cross_entropy(logits, torch.arange(len(x)) + rank * len(x))
    out = model(x)
    return nn.functional.cross_entropy(out[:, :10], y)


times = []
for step in range(a.steps):
    if a.barrier_each_step:
        dist.barrier()
    t = time.perf_counter()
    if a.straggler and rank == 1:
        time.sleep(0.008)
    opt.zero_grad()
    for _ in range(a.accumulate_syncing):
        loss = loss_of_step() / a.accumulate_syncing
        loss.backward()
    opt.step()
    if a.gradient_penalty and step % 5 == 4:
        g_opt.zero_grad()
        (-model(generator(torch.randn(len(x), 64))).mean()).backward()
        g_opt.step()
    if a.rank0_logging and rank == 0:
        with open(os.path.join(log_dir, "metrics.jsonl"), "a") as f:
            f.write(json.dumps({"step": step, "loss": loss.item()}) + "\n")
        torch.save({k: v.clone() for k, v in model.module.state_dict().items()}, os.path.join(log_dir, "last.pt"))
    times.append(time.perf_counter() - t)
if rank == 0:
    print(f"median iteration time: {statistics.median(times[len(times)//2:]) * 1000:.3f} ms")
