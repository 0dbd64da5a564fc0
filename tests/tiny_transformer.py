"""The small language model the memory tests share: the course's TransformerModel at toy sizes, with a batch."""

import torch

from utils import models

SMALL = models.TransformerConfig(vocab_size=512, d_model=64, nhead=4, num_layers=2, dim_feedforward=128, dropout=0.0)


def small_lm(seed=0):
    """A fresh model of SMALL's sizes and a 4 × 16 batch of token ids and targets, all from ``seed``."""
    torch.manual_seed(seed)
    model = models.TransformerModel(SMALL)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(0, SMALL.vocab_size, (4, 16), generator=gen)
    y = torch.randint(0, SMALL.vocab_size, (4, 16), generator=gen)
    return model, x, y
