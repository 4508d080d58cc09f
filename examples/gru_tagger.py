"""A sequence tagger: a word embedding (20,000 x 96, dense gradients), a two-layer bidirectional GRU and a linear head
per token, trained with Adagrad on padded synthetic sentences (padding ignored by the loss); its gradients are one
large embedding tensor and many small recurrent ones."""
import torch
from torch import nn

from common import parse_args, train

VOCAB, TAGS, LENGTH = 20_000, 12, 40


class Tagger(nn.Module):
    def __init__(self, dim: int = 96, hidden: int = 128):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim, padding_idx=0)
        self.gru = nn.GRU(dim, hidden, num_layers=2, batch_first=True, bidirectional=True, dropout=0.1)
        self.head = nn.Linear(2 * hidden, TAGS)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out, _ = self.gru(self.embed(tokens))
        return self.head(out).flatten(0, 1)  # (batch * length, tags)


def make_batch(batch_size: int, generator: torch.Generator):
    tokens = torch.randint(1, VOCAB, (batch_size, LENGTH), generator=generator)
    tags = torch.randint(0, TAGS, (batch_size, LENGTH), generator=generator)
    lengths = torch.randint(LENGTH // 2, LENGTH + 1, (batch_size,), generator=generator)
    padding = torch.arange(LENGTH)[None, :] >= lengths[:, None]
    tokens[padding] = 0
    tags[padding] = -100
    return tokens, tags.flatten()


if __name__ == "__main__":
    args = parse_args(__doc__, batch_size=32, optimizer="adagrad")
    train(Tagger(), make_batch, nn.CrossEntropyLoss(ignore_index=-100), args)
