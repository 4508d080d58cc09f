"""A small U-Net (encoder-decoder with skip connections, GroupNorm, SiLU, transposed-conv upsampling) trained for
per-pixel segmentation of 64x64 synthetic images with AdamW; --freeze-stem leaves its first block untrained (a
frozen layer, as a fine-tune does)."""
import torch
from torch import nn

from common import parse_args, train


def block(cin: int, cout: int) -> nn.Module:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.GroupNorm(8, cout), nn.SiLU(),
                         nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.GroupNorm(8, cout), nn.SiLU())


class UNet(nn.Module):
    def __init__(self, width: int = 16, classes: int = 5):
        super().__init__()
        w = width
        self.down = nn.ModuleList([block(3, w), block(w, 2 * w), block(2 * w, 4 * w)])
        self.middle = block(4 * w, 8 * w)
        self.up = nn.ModuleList([nn.ConvTranspose2d(8 * w, 4 * w, 2, 2), nn.ConvTranspose2d(4 * w, 2 * w, 2, 2),
                                 nn.ConvTranspose2d(2 * w, w, 2, 2)])
        self.merge = nn.ModuleList([block(8 * w, 4 * w), block(4 * w, 2 * w), block(2 * w, w)])
        self.head = nn.Conv2d(w, classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for stage in self.down:
            x = stage(x)
            skips.append(x)
            x = nn.functional.max_pool2d(x, 2)
        x = self.middle(x)
        for upsample, merge, skip in zip(self.up, self.merge, reversed(skips)):
            x = merge(torch.cat([upsample(x), skip], dim=1))
        return self.head(x)


def make_batch(batch_size: int, generator: torch.Generator):
    return (torch.randn(batch_size, 3, 64, 64, generator=generator),
            torch.randint(0, 5, (batch_size, 64, 64), generator=generator))


def add_arguments(parser) -> None:
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--freeze-stem", action="store_true", help="the first encoder block is not trained")


if __name__ == "__main__":
    args = parse_args(__doc__, add_arguments, batch_size=8, optimizer="adam")
    model = UNet(args.width)
    if args.freeze_stem:
        model.down[0].requires_grad_(False)
    train(model, make_batch, nn.CrossEntropyLoss(), args)
