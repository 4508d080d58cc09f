"""An MLP whose trunk holds bfloat16 parameters and whose head holds float32 ones: DDP buckets each dtype apart
(`--trunk-dtype float16`: a float16 trunk, as Horovod, which has no bfloat16, runs it: examples/horovod_mlp.py)."""
import torch
from torch import nn

from common import parse_args, train


class MixedDtypeMLP(nn.Module):
    def __init__(self, width: int = 512, trunk_depth: int = 6, head_depth: int = 4,
                 trunk_dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        trunk = [nn.Linear(64, width), nn.ReLU()]
        for _ in range(trunk_depth):
            trunk += [nn.Linear(width, width), nn.ReLU()]
        head = []
        for _ in range(head_depth):
            head += [nn.Linear(width, width), nn.ReLU()]
        self.trunk = nn.Sequential(*trunk).to(trunk_dtype)
        self.trunk_dtype = trunk_dtype
        self.head = nn.Sequential(*head, nn.Linear(width, 10))

    def forward(self, x):
        return self.head(self.trunk(x.to(self.trunk_dtype)).float())


def make_batch(batch_size: int, generator: torch.Generator):
    return torch.randn(batch_size, 64, generator=generator), torch.randint(0, 10, (batch_size,), generator=generator)


if __name__ == "__main__":
    args = parse_args(__doc__, lambda parser: parser.add_argument("--trunk-dtype", choices=("bfloat16", "float16"),
                                                                  default="bfloat16"))
    train(MixedDtypeMLP(trunk_dtype=getattr(torch, args.trunk_dtype)), make_batch, nn.CrossEntropyLoss(), args)
