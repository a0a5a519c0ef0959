"""Evaluation of a model from the store: validation loss and perplexity on the held-out split.

Design choices: fixed, non-overlapping validation windows (deterministic, identical for every model of a
run) so losses are comparable across the initial, final and fine-tuned checkpoints.
"""

from __future__ import annotations

import math

import torch

from ddiloco.data import val_batches
from ddiloco.model import GPT


@torch.no_grad()
def validation_loss(
    model: GPT, val_tokens: torch.Tensor, *, batch_size: int, seq_len: int, max_batches: int
) -> float:
    """Mean token cross-entropy (nats) over the first `max_batches` validation windows."""
    model.eval()
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for x, y in val_batches(val_tokens, batch_size=batch_size, seq_len=seq_len, max_batches=max_batches):
        _, loss = model(x.to(device), y.to(device))
        total += float(loss) * y.numel()
        count += y.numel()
    model.train()
    if count == 0:
        raise ValueError("the validation split is shorter than one batch; raise data.val_fraction")
    return total / count


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0))
