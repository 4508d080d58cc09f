"""Many small linear layers: lots of small gradients, so communication and its latency dominate."""
import torch
from torch import nn

from common import parse_args, train


def build(width: int = 256, depth: int = 24) -> nn.Module:
    layers = [nn.Linear(64, width), nn.ReLU()]
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, 10))
    return nn.Sequential(*layers)


def make_batch(batch_size: int, generator: torch.Generator):
    return torch.randn(batch_size, 64, generator=generator), torch.randint(0, 10, (batch_size,), generator=generator)


if __name__ == "__main__":
    args = parse_args(__doc__)
    train(build(), make_batch, nn.CrossEntropyLoss(), args)
