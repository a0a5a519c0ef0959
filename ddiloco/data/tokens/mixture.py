"""Batches drawn from several streamed corpora with weights (e.g. 70% text, 30% code), resumably.

Design choices:
- One `StreamLoader` per source over this learner's slot of it; each batch comes whole from one source,
  chosen by a generator seeded with (seed, draw number), so the n-th batch's source depends only on the
  seed and n: a resumed learner draws what an uninterrupted one would, and the realised shares converge to
  the weights (normalised) as batches accumulate. Choosing per batch, not per sequence, keeps every source's
  reads sequential and the loaders unchanged.
- The cursor is the draw count, each source's cursor and the tokens handed out per source (so the counts
  survive restarts and the summary can report them); a cursor of another mixture (other names) is refused.
- `epochs_read` is the weighted mean of the sources' passes: monotone, 1.0 when every source was read once
  at its weight's pace.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ddiloco.data.tokens.stream import StreamLoader

__all__ = ["MixtureLoader"]

CURSOR_FORMAT = "ddiloco.data.tokens.mixture/1"


class MixtureLoader:
    """`ShardLoader`'s interface over weighted `StreamLoader`s (see the module docstring)."""

    def __init__(
        self, loaders: Sequence[StreamLoader], names: Sequence[str], weights: Sequence[float], *, seed: int
    ):
        if not loaders or not (len(loaders) == len(names) == len(weights)):
            raise ValueError("a mixture needs one name and one weight per loader, and at least one loader")
        if len({ld.tokens_per_batch for ld in loaders}) != 1:
            raise ValueError("every source of a mixture must give batches of the same shape")
        total = float(sum(weights))
        if not all(w > 0 for w in weights) or not np.isfinite(total):
            raise ValueError(f"mixture weights must be positive and finite, got {list(weights)}")
        self.loaders, self.names = list(loaders), list(names)
        self.probs = np.array([w / total for w in weights])
        self.seed, self.draws = seed, 0
        self.tokens_by_source = dict.fromkeys(self.names, 0)

    @property
    def batch_size(self) -> int:
        return self.loaders[0].batch_size

    @property
    def seq_len(self) -> int:
        return self.loaders[0].seq_len

    @property
    def tokens_per_batch(self) -> int:
        return self.loaders[0].tokens_per_batch

    @property
    def epochs_read(self) -> float:
        return float(sum(p * ld.epochs_read for p, ld in zip(self.probs, self.loaders, strict=True)))

    def _source(self, draw: int) -> int:
        u = np.random.default_rng([self.seed % 2**64, 0x313, draw]).random()
        return min(int(np.searchsorted(np.cumsum(self.probs), u, side="right")), len(self.loaders) - 1)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        i = self._source(self.draws)
        batch = self.loaders[i].next_batch()  # raises before counting: a retried call draws the same source
        self.draws += 1
        self.tokens_by_source[self.names[i]] += self.tokens_per_batch
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {
            "format": CURSOR_FORMAT,
            "seed": self.seed,
            "draws": self.draws,
            "names": list(self.names),
            "tokens_by_source": dict(self.tokens_by_source),
            "sources": [ld.state_dict() for ld in self.loaders],
        }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        if d.get("format") != CURSOR_FORMAT or not isinstance(d.get("sources"), list):
            raise ValueError(
                f"data cursor is not a mixture cursor ({CURSOR_FORMAT}); it belongs to another run"
            )
        if d.get("names") != self.names:
            raise ValueError(f"data cursor is of the mixture {d.get('names')}, this run mixes {self.names}")
        for ld, sd in zip(self.loaders, d["sources"], strict=True):
            ld.load_state_dict(sd)
        self.seed, self.draws = int(d["seed"]), int(d["draws"])
        self.tokens_by_source = {n: int(d["tokens_by_source"].get(n, 0)) for n in self.names}

    def close(self) -> None:
        for ld in self.loaders:
            ld.close()
