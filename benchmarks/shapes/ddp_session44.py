"""PyTorch scripts of shapes not tuned for (session 44), one flag each; run with `dprorun -np 2 python
ddp_session44.py`.

--per-sample: DP-SGD by hand, no DDP: per-sample gradients with torch.func (vmap of grad over a functional call;
no `loss.backward()`), each clipped, summed, noised, all-reduced flat by the script and set as `.grad`.
--qat: quantization-aware training under DDP (a fused conv-BN-ReLU net prepared by torch.ao.quantization: fake
quantizers and observers, their buffers broadcast by DDP at every forward). --anomaly: DDP under
torch.autograd.set_detect_anomaly(True) (every backward op records its forward's stack). --zero-by-hand: a ZeRO-2 shape by
hand, no DDP: the flat gradient reduce-scattered, each rank steps its shard, the parameters all-gathered.
--packed-lstm: an LSTM over packed padded sequences of lengths drawn per step (DDP; shapes change every step).
"""
import argparse, statistics, time
import torch, torch.distributed as dist, torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser(); p.add_argument("--steps", type=int, default=40)
for flag in ("--per-sample", "--qat", "--anomaly", "--zero-by-hand", "--packed-lstm"):
    p.add_argument(flag, action="store_true")
a = p.parse_args()
dist.init_process_group("gloo"); torch.manual_seed(0); torch.set_num_threads(1)
rank, world = dist.get_rank(), dist.get_world_size()


class Packed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(500, 64)
        self.lstm = nn.LSTM(64, 128, batch_first=True)
        self.out = nn.Linear(128, 5)

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        packed = nn.utils.rnn.pack_padded_sequence(self.embed(tokens), lengths, batch_first=True,
                                                   enforce_sorted=False)
        _, (h, _) = self.lstm(packed)
        return self.out(h[-1])


def conv_net() -> nn.Module:
    from torch.ao.quantization import fuse_modules_qat, get_default_qat_qconfig, prepare_qat

    net = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                        nn.Conv2d(32, 64, 3, padding=1, stride=2), nn.BatchNorm2d(64), nn.ReLU(),
                        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))
    net.train()
    net = fuse_modules_qat(net, [["0", "1", "2"], ["3", "4", "5"]])
    net.qconfig = get_default_qat_qconfig("x86")
    return prepare_qat(net)


mlp = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
if a.qat:
    net, x, y = conv_net(), torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))
elif a.packed_lstm:
    net = Packed()
else:
    net = mlp
times: list[float] = []


def per_sample_step(params: dict, opt: torch.optim.Optimizer) -> None:
    from torch.func import functional_call, grad, vmap

    def loss_of(prm: dict, xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(functional_call(net, prm, (xi.unsqueeze(0),)), yi.unsqueeze(0))

    grads = vmap(grad(loss_of), in_dims=(None, 0, 0))(params, x[:16], y[:16])
    norms = torch.sqrt(sum(g.flatten(1).pow(2).sum(1) for g in grads.values()))
    factor = (1.0 / (norms + 1e-6)).clamp(max=1.0)
    flat = torch.cat([(g * factor.view(-1, *[1] * (g.dim() - 1))).sum(0).flatten() for g in grads.values()])
    flat += torch.randn_like(flat) * 0.01
    dist.all_reduce(flat)
    flat /= world * 16
    offset = 0
    for prm in net.parameters():
        prm.grad = flat[offset:offset + prm.numel()].view_as(prm).clone(); offset += prm.numel()
    opt.step()


def zero_step(opt: torch.optim.Optimizer, shard: torch.Tensor, flat_params: torch.Tensor) -> None:
    net.zero_grad()  # the shard's gradient is overwritten by the reduce-scatter
    F.cross_entropy(net(x), y).backward()
    grads = torch.cat([prm.grad.flatten() for prm in net.parameters()])
    dist.reduce_scatter(shard.grad, list(grads.div_(world).chunk(world)))
    opt.step()
    dist.all_gather_into_tensor(flat_params, shard.detach())
    offset = 0
    with torch.no_grad():
        for prm in net.parameters():
            prm.copy_(flat_params[offset:offset + prm.numel()].view_as(prm)); offset += prm.numel()


def main() -> None:
    if a.per_sample:
        dist.broadcast(torch.nn.utils.parameters_to_vector(net.parameters()), 0)
        params = {k: v.detach() for k, v in net.named_parameters()}
        opt = torch.optim.SGD(net.parameters(), lr=0.05)
    elif a.zero_by_hand:
        flat_params = torch.nn.utils.parameters_to_vector(net.parameters()).detach()
        dist.broadcast(flat_params, 0)
        shard = flat_params.chunk(world)[rank].clone().requires_grad_(True)
        shard.grad = torch.zeros_like(shard)
        opt = torch.optim.AdamW([shard], lr=1e-3)
    else:
        model = nn.parallel.DistributedDataParallel(net, bucket_cap_mb=2)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    torch.autograd.set_detect_anomaly(a.anomaly)
    lengths_rng = torch.Generator().manual_seed(rank)
    for step in range(a.steps):
        t = time.perf_counter()
        if a.per_sample:
            per_sample_step(params, opt)
            params = {k: v.detach() for k, v in net.named_parameters()}
        elif a.zero_by_hand:
            zero_step(opt, shard, flat_params)
        else:
            opt.zero_grad()
            if a.packed_lstm:
                lengths = torch.randint(8, 48, (32,), generator=lengths_rng)
                tokens = torch.randint(1, 500, (32, int(lengths.max())))
                out = model(tokens, lengths)
                loss = F.cross_entropy(out, torch.randint(0, 5, (32,)))
            else:
                loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
        times.append(time.perf_counter() - t)
    if rank == 0:
        print(f"steps: {a.steps}; median iteration time: {statistics.median(times[len(times)//2:]) * 1000:.3f} ms")


main()
dist.destroy_process_group()
