"""Validation batches read from the held-out token chunks of a corpus.

Design choices:
- Like `ddiloco.data.loader.val_batches`: fixed, non-overlapping windows of seq_len + 1 tokens (starts at
  multiples of seq_len, each window's last token is the next one's first), in the plan's order of the
  validation chunks and from the start of each, batch_size per batch (the last may be smaller), so the
  numbers are the same every time. A window never crosses a chunk.
- Only the tokens of the windows kept are read (`max_batches` bounds them), a chunk at a time with one
  range read each.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ddiloco.data.tokens.corpus import TokenCorpus, files_of
from ddiloco.data.tokens.npy import read_tokens
from ddiloco.store.base import Store

__all__ = ["val_batches_from"]


def val_batches_from(
    store: Store,
    corpus_or_manifest: TokenCorpus | dict[str, Any],
    val_chunks: Sequence[Sequence[int]],
    *,
    batch_size: int,
    seq_len: int,
    max_batches: int | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """[(x, y)] int64 batches of shape (batch_size, seq_len) from the validation chunks."""
    if batch_size < 1 or seq_len < 1:
        raise ValueError(f"batch_size and seq_len must be positive, got {batch_size} and {seq_len}")
    files = files_of(corpus_or_manifest)
    want = None if max_batches is None else max_batches * batch_size
    windows: list[np.ndarray] = []
    n = 0
    for f, start, count in val_chunks:
        k = (int(count) - 1) // seq_len  # windows in this chunk
        if want is not None:
            k = min(k, want - n)
        if k <= 0:
            if want is not None and n >= want:
                break
            continue
        tokens = read_tokens(store, files[int(f)], int(start), k * seq_len + 1)
        idx = np.arange(k)[:, None] * seq_len + np.arange(seq_len + 1)  # (k, T+1)
        windows.append(tokens[idx].astype(np.int64))
        n += k
    if not windows:
        raise ValueError(
            f"the {len(val_chunks)} validation chunks hold no sequence of seq_len + 1 = {seq_len + 1} tokens; "
            "hold out more validation tokens or use a shorter seq_len"
        )
    all_windows = torch.from_numpy(np.concatenate(windows))  # (N, T+1)
    return [(w[:, :-1].contiguous(), w[:, 1:].contiguous()) for w in all_windows.split(batch_size)]
