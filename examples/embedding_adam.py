"""Embedding-heavy recommender trained with Adam under DDP: two large tables, a frozen one, a tied output.

A shape unlike the other examples: most bytes sit in two embedding tables (users 50,000 x 64, items 20,000 x 64;
dense gradients, so DDP all-reduces whole tables), a third table (categories) is frozen (no gradient, no
bucket), the output projection is tied to the item table (one parameter used twice: its gradient is ready only
after both uses), and the optimizer keeps per-parameter state (Adam: two moments per weight; `--optimizer
adagrad` one). `--sparse` makes the user table's gradient sparse (`nn.Embedding(sparse=True)`: DDP gives it a bucket of
its own and gloo gathers each rank's rows instead of all-reducing the table; Adam refuses sparse gradients, so
with it the optimizer must be sgd or adagrad). Runs unchanged under torchrun and dprorun:

    dprorun -np 2 python examples/embedding_adam.py --steps 40
    dprorun -np 2 python examples/embedding_adam.py --steps 40 --sparse --optimizer adagrad
"""
import torch
from torch import nn

from common import parse_args, train


class Recommender(nn.Module):
    def __init__(self, users: int = 50_000, items: int = 20_000, categories: int = 1_000, dim: int = 64,
                 sparse: bool = False):
        super().__init__()
        self.user = nn.Embedding(users, dim, sparse=sparse)
        self.item = nn.Embedding(items, dim)
        self.category = nn.Embedding(categories, dim)
        self.category.weight.requires_grad_(False)  # frozen: pretrained, not trained here
        self.mlp = nn.Sequential(nn.Linear(3 * dim, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                                 nn.Linear(256, dim))
        self.sizes = (users, items, categories)

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        features = torch.cat([self.user(batch[:, 0]), self.item(batch[:, 1]), self.category(batch[:, 2])], dim=1)
        return self.mlp(features) @ self.item.weight.t()  # scores over every item, tied to the item table


def main() -> None:
    def sparse_option(parser):
        parser.add_argument("--sparse", action="store_true", help="a sparse gradient for the user table")

    args = parse_args(__doc__.splitlines()[0], sparse_option, optimizer="adam", batch_size=64)
    if args.sparse and args.optimizer == "adam":
        raise SystemExit("--sparse: Adam does not take sparse gradients; use --optimizer sgd or adagrad")
    model = Recommender(sparse=args.sparse)
    users, items, categories = model.sizes

    def make_batch(batch_size: int, generator: torch.Generator):
        batch = torch.stack([torch.randint(0, users, (batch_size,), generator=generator),
                             torch.randint(0, items, (batch_size,), generator=generator),
                             torch.randint(0, categories, (batch_size,), generator=generator)], dim=1)
        return batch, torch.randint(0, items, (batch_size,), generator=generator)

    train(model, make_batch, nn.CrossEntropyLoss(), args)


if __name__ == "__main__":
    main()
