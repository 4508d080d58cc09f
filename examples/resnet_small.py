"""A small ResNet-style CNN (basic residual blocks, batch norm) on 32x32 synthetic images."""
import torch
from torch import nn

from common import parse_args, train


class Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.skip = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                     if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x):
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.skip(x))


def build(width: int = 16) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
        Block(width, width, 1), Block(width, 2 * width, 2), Block(2 * width, 4 * width, 2),
        Block(4 * width, 4 * width, 1), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4 * width, 10))


def make_batch(batch_size: int, generator: torch.Generator):
    return (torch.randn(batch_size, 3, 32, 32, generator=generator),
            torch.randint(0, 10, (batch_size,), generator=generator))


if __name__ == "__main__":
    args = parse_args(__doc__, batch_size=16)
    train(build(), make_batch, nn.CrossEntropyLoss(), args)
