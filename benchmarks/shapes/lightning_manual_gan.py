"""A Lightning GAN with manual optimization (automatic_optimization=False: training_step runs the backward and steps
the two optimizers itself, inside the DDP wrapper), strategy ddp_find_unused_parameters_true. Run with
`dprorun -np 2 python benchmarks/shapes/lightning_manual_gan.py`."""
import argparse, os, statistics, time, torch, torch.nn as nn
import lightning as L
from torch.utils.data import DataLoader, TensorDataset
p = argparse.ArgumentParser(); p.add_argument("--steps", type=int, default=40)
a = p.parse_args()
torch.set_num_threads(1)


class GAN(L.LightningModule):
    def __init__(s):
        super().__init__()
        s.automatic_optimization = False
        s.G = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 256))
        s.D = nn.Sequential(nn.Linear(256, 512), nn.LeakyReLU(0.2), nn.Linear(512, 1))
        s.times = []

    def training_step(s, batch, k):
        t = time.perf_counter()
        (real,) = batch
        g_opt, d_opt = s.optimizers()
        z = torch.randn(len(real), 64)
        fake = s.G(z)
        d_loss = nn.functional.softplus(s.D(fake.detach())).mean() + nn.functional.softplus(-s.D(real)).mean()
        d_opt.zero_grad(); s.manual_backward(d_loss); d_opt.step()
        g_loss = nn.functional.softplus(-s.D(fake)).mean()
        g_opt.zero_grad(); s.manual_backward(g_loss); g_opt.step()
        s.times.append(time.perf_counter() - t)

    def configure_optimizers(s):
        return torch.optim.Adam(s.G.parameters(), 2e-4), torch.optim.Adam(s.D.parameters(), 2e-4)


world = int(os.environ.get("WORLD_SIZE", "1"))
module = GAN()
data = DataLoader(TensorDataset(torch.randn(4096, 256)), batch_size=64, shuffle=True)
trainer = L.Trainer(accelerator="cpu", devices=world, strategy="ddp_find_unused_parameters_true", max_steps=2 * a.steps,
                    logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
trainer.fit(module, data)
if trainer.global_rank == 0:
    print(f"median step {statistics.median(module.times[len(module.times) // 2:]) * 1000:.3f} ms")
