"""The small models the notebooks train, each readable in one screen; random initialisation only.

- :class:`MLP`: the seed's MNIST classifier, ``Linear(784, 256) → ReLU → Linear(256, 10)``.
- :class:`TransformerModel`: the seed's language model, ``Embedding → nn.TransformerEncoder → Linear``, sized
  by a :class:`TransformerConfig` (the seed's sizes are the defaults; notebooks shrink them on CPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


class MLP(nn.Module):
    """The seed's MNIST classifier: flatten 28×28 → 784 → 256 (ReLU) → 10 logits."""

    def __init__(self, in_features: int = 784, hidden: int = 256, classes: int = 10) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


@dataclass(frozen=True)
class TransformerConfig:
    """Sizes of :class:`TransformerModel`; the defaults are the seed's (70.2 M parameters by
    :func:`count_parameters`: the embedding and the vocabulary head hold 51 M of them; a test checks the count)."""

    vocab_size: int = 50_000
    d_model: int = 512
    nhead: int = 8
    num_layers: int = 6
    dim_feedforward: int = 2048
    dropout: float = 0.1

    def __post_init__(self) -> None:
        if self.d_model % self.nhead:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by nhead ({self.nhead})")


class TransformerModel(nn.Module):
    """The seed's language model: token embedding → ``num_layers`` encoder layers (batch-first) → vocabulary.

    ``forward(tokens)`` takes int64 ids [B, T] and returns logits [B, T, vocab]. With ``causal=True`` (default)
    each position attends only to itself and earlier ones, so it predicts the next token.
    """

    def __init__(self, config: TransformerConfig | None = None) -> None:
        super().__init__()
        self.config = config = config or TransformerConfig()
        self.embedding = nn.Embedding(config.vocab_size, config.d_model)
        layer = nn.TransformerEncoderLayer(config.d_model, config.nhead, config.dim_feedforward, config.dropout,
                                           batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, config.num_layers, enable_nested_tensor=False)
        self.head = nn.Linear(config.d_model, config.vocab_size)

    def features(self, tokens: torch.Tensor, causal: bool = True) -> torch.Tensor:
        """The encoder's output [B, T, d_model]: everything but the vocabulary head."""
        if tokens.dtype != torch.int64 or tokens.dim() != 2:
            raise ValueError(f"tokens must be int64 [batch, seq], got {tokens.dtype} {list(tokens.shape)}")
        x = self.embedding(tokens)
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1], device=tokens.device) if causal \
            else None
        return self.encoder(x, mask=mask, is_causal=causal)

    def forward(self, tokens: torch.Tensor, causal: bool = True) -> torch.Tensor:
        return self.head(self.features(tokens, causal))


def count_parameters(model: nn.Module) -> int:
    """Number of trainable parameters."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def seed_train_batch(memory_bytes: int) -> int:
    """Sequences of 256 tokens per training step of the seed :class:`TransformerModel` for a GPU of
    ``memory_bytes``: its fp32 step at 16 × 256 takes about 4 GiB before the CUDA context, so 32 on GPUs of 30 GiB
    and more, 16 on a 16 GB T4, down to 4 on a 4 GB laptop GPU.

    Raises:
        ValueError: for a non-positive size.
    """
    if memory_bytes <= 0:
        raise ValueError(f"seed_train_batch() needs the GPU's memory in bytes, got {memory_bytes}")
    gib = memory_bytes / 2**30
    return 32 if gib >= 30 else 16 if gib >= 14 else 8 if gib >= 7 else 4
