"""An MLP whose trunk holds bfloat16 parameters and whose head holds float32 ones: DDP buckets each dtype apart."""
import torch
from torch import nn

from common import parse_args, train


class MixedDtypeMLP(nn.Module):
    def __init__(self, width: int = 512, trunk_depth: int = 6, head_depth: int = 4) -> None:
        super().__init__()
        trunk = [nn.Linear(64, width), nn.ReLU()]
        for _ in range(trunk_depth):
            trunk += [nn.Linear(width, width), nn.ReLU()]
        head = []
        for _ in range(head_depth):
            head += [nn.Linear(width, width), nn.ReLU()]
        self.trunk = nn.Sequential(*trunk).to(torch.bfloat16)
        self.head = nn.Sequential(*head, nn.Linear(width, 10))

    def forward(self, x):
        return self.head(self.trunk(x.to(torch.bfloat16)).float())


def make_batch(batch_size: int, generator: torch.Generator):
    return torch.randn(batch_size, 64, generator=generator), torch.randint(0, 10, (batch_size,), generator=generator)


if __name__ == "__main__":
    args = parse_args(__doc__)
    train(MixedDtypeMLP(), make_batch, nn.CrossEntropyLoss(), args)
