"""The language-model training step the course measures, with every mixed-precision option in one place.

:func:`train_step` is the production step of notebook 03 (autocast, GradScaler, unscale before clipping) and the
step notebook 04 compiles; keeping it here means both measure the same code.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of logits [B, T, V] against targets [B, T] (computed in fp32 by autocast)."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    *,
    amp_dtype: torch.dtype | None = None,
    scaler: torch.amp.GradScaler | None = None,
    max_grad_norm: float | None = 1.0,
) -> torch.Tensor:
    """One optimisation step of a language model; returns the loss as a detached device tensor (no sync).

    Args:
        amp_dtype: ``torch.float16`` or ``torch.bfloat16`` to run the forward pass under
            ``torch.autocast(device_type, dtype)``; None for full precision.
        scaler: a ``torch.amp.GradScaler`` (needed with fp16, whose small gradients underflow otherwise).
        max_grad_norm: clip the gradient norm to this (None: no clipping). With a scaler the gradients are
            unscaled first, so the threshold applies to the true gradients.
    """
    if amp_dtype not in (None, torch.float16, torch.bfloat16):
        raise ValueError(f"amp_dtype must be None, torch.float16 or torch.bfloat16, got {amp_dtype}")
    device_type = inputs.device.type
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast(device_type, dtype=amp_dtype, enabled=amp_dtype is not None):
        loss = lm_loss(model(inputs), targets)
    if scaler is not None:
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)  # true gradients, so that clipping sees their real norm
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        scaler.step(optimizer)  # skipped if the unscaled gradients hold inf/NaN
        scaler.update()  # lower the scale after a skip, raise it after a run of good steps
    else:
        loss.backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        optimizer.step()
    return loss.detach()
