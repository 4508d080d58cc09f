"""A small Transformer encoder classifier on synthetic token sequences."""
import torch
from torch import nn

from common import parse_args, train

VOCAB, SEQ = 1000, 64


class Classifier(nn.Module):
    def __init__(self, dim: int = 128, heads: int = 4, layers: int = 4):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        layer = nn.TransformerEncoderLayer(dim, heads, dim_feedforward=4 * dim, batch_first=True, dropout=0.0)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, 10)

    def forward(self, tokens):
        return self.head(self.encoder(self.embed(tokens)).mean(dim=1))


def make_batch(batch_size: int, generator: torch.Generator):
    return (torch.randint(0, VOCAB, (batch_size, SEQ), generator=generator),
            torch.randint(0, 10, (batch_size,), generator=generator))


if __name__ == "__main__":
    args = parse_args(__doc__, batch_size=16)
    train(Classifier(), make_batch, nn.CrossEntropyLoss(), args)
