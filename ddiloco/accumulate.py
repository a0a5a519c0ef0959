"""A round's merge as running sums: each answer is added as it arrives, and the merge is a finalisation.

`ddiloco.merge.merge_with_stats` takes the M outer gradients of a round at once, so a round holds M decoded
fp32 copies of its fragment until quorum + grace. `RoundSums` keeps, per tensor, the sums the merge needs and
per answer only a few floats, so an open round costs two fragment-sized fp32 buffers whatever M is, plus the
one answer being added.

Design choices:
- Sums per tensor t over answers m with weight w_m > 0: ``S_t = Σ w_m Δ_mt`` (the weighted mean's numerator,
  also RDA's fallback) and, for RDA tensors, ``D_t = Σ (w_m / ‖Δ_mt‖) Δ_mt`` (the direction numerator).
  Per answer only its weight and its per-tensor norms are kept. The finalisation divides by Σ w, so the
  result equals the batch merge up to fp32 summation order (relative ~1e-7; the tests hold it to 1e-6).
- An answer is checked whole (names, shapes, finite norms) before anything is added, so a bad answer never
  leaves a partial sum behind; the caller holds one decoded answer at a time and drops it after `add`.
- Robust clipping (scale answers whose global norm exceeds factor × the round's median norm, as
  `validation.clip_outliers`) needs the median, known only once the round closes. It is applied at
  finalisation: the norms are known, so the radius uses the clipped norms; a positive scale does not change
  a direction; and the mean is corrected by ``S_t - (1 - s_m) w_m Δ_mt`` for each clipped answer m, read
  again through `reread` (clipping is rare, and so is the second read). The result is `clip_outliers`
  followed by the batch merge.
- One answer with positive weight gives back exactly its Δ in the batch merge, and w·Δ/w can round, so that
  case rereads the answer and returns it as it is.
- `finalize` leaves the sums untouched: a merge whose persisting fails is finalised again later.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Container, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from ddiloco.merge import METHODS

Tensors = Mapping[str, Tensor]
Reread = Callable[[str], Tensors]
"""Reads an answer's outer gradient again by the key it was added under (clipping, single answers)."""


@dataclass(frozen=True, slots=True)
class AnswerNorms:
    weight: float
    norms: dict[str, float]
    """Per tensor: ‖Δ_mt‖."""

    @property
    def global_norm(self) -> float:
        return math.sqrt(sum(n * n for n in self.norms.values()))


@dataclass(frozen=True, slots=True)
class Finalized:
    merged: dict[str, Tensor]
    stats: dict[str, float]
    """As `merge_with_stats`: merged_norm, mean_delta_norm, ratio, fallbacks, learners."""
    clipped: dict[str, float]
    """Answer key -> the scale robust clipping applied to it (clipped answers only)."""


class RoundSums:
    """The running sums of one round of one fragment (see the module docstring)."""

    def __init__(
        self,
        shapes: Mapping[str, torch.Size | tuple[int, ...]],
        *,
        method: str = "rda",
        embedding_names: Container[str] = frozenset(),
        eps: float = 1e-6,
    ) -> None:
        if method not in METHODS:
            raise ValueError(f"unknown merge method {method!r}; expected one of {', '.join(METHODS)}")
        self.eps = eps
        self.shapes = {n: torch.Size(s) for n, s in shapes.items()}
        self.rda_names = frozenset(n for n in self.shapes if method == "rda" and n not in embedding_names)
        self.sums = {n: torch.zeros(s, dtype=torch.float32) for n, s in self.shapes.items()}
        self.directions = {n: torch.zeros(self.shapes[n], dtype=torch.float32) for n in self.rda_names}
        self.answers: dict[str, AnswerNorms] = {}

    def __len__(self) -> int:
        return len(self.answers)

    def nbytes(self) -> int:
        """Bytes held by the sums (what an open round costs)."""
        return sum(t.numel() * 4 for t in (*self.sums.values(), *self.directions.values()))

    def add(self, key: str, weight: float, delta: Tensors) -> AnswerNorms:
        """Add answer `key`: its outer gradient Δ (every tensor of the fragment) and its merge weight."""
        if key in self.answers:
            raise ValueError(f"answer {key!r} was added to this round already")
        if not (math.isfinite(weight) and weight >= 0):
            raise ValueError(f"weight of {key!r} is {weight}; merge weights must be finite and >= 0")
        if set(delta) != set(self.shapes):
            missing, extra = sorted(set(self.shapes) - set(delta)), sorted(set(delta) - set(self.shapes))
            raise ValueError(f"answer {key!r} lacks tensors {missing} and has unknown {extra}")
        norms = {}
        for name, t in delta.items():
            if not isinstance(t, Tensor) or not t.is_floating_point() or t.shape != self.shapes[name]:
                raise ValueError(
                    f"answer {key!r}: {name} must be a float tensor of shape {list(self.shapes[name])}"
                )
            norms[name] = n = float(torch.linalg.vector_norm(t, dtype=torch.float32))
            if not math.isfinite(n):
                raise ValueError(f"answer {key!r}: {name} holds NaN/Inf values (its norm is not finite)")
        if weight > 0:
            for name, t in delta.items():
                self.sums[name].add_(t, alpha=weight)
                if name in self.rda_names and norms[name] > 0:
                    self.directions[name].add_(t, alpha=weight / norms[name])
        self.answers[key] = answer = AnswerNorms(float(weight), norms)
        return answer

    def clip_scales(self, factor: float | None) -> dict[str, float]:
        """Answer key -> scale, for the answers robust clipping scales down (`validation.clip_outliers`)."""
        if factor is None or len(self.answers) < 2:
            return {}
        norms = {k: a.global_norm for k, a in self.answers.items()}
        bound = factor * statistics.median(norms.values())
        return {k: bound / n for k, n in norms.items() if n > bound and n > 0}

    def finalize(self, reread: Reread, robust_clip: float | None = None) -> Finalized:
        """The merged outer gradient of the answers added so far (fp32, fresh tensors) and its stats."""
        active = {k: a for k, a in self.answers.items() if a.weight > 0}
        if not active:
            raise ValueError("all merge weights are 0 (no answering learner took a step); nothing to merge")
        total = sum(a.weight for a in active.values())
        scales = self.clip_scales(robust_clip)
        if len(active) == 1:
            [(key, answer)] = active.items()
            s = scales.get(key, 1.0)
            merged = {n: _scaled(t, s) for n, t in reread(key).items()}
            return self._finish(merged, active, total, scales, fallbacks=0)
        means = {n: t.clone() for n, t in self.sums.items()}
        for key, s in scales.items():
            w = self.answers[key].weight
            if w > 0:
                for n, t in reread(key).items():
                    means[n].add_(t, alpha=-(1.0 - s) * w)
        merged, fallbacks = {}, 0
        for name, mean in means.items():
            mean.div_(total)
            if name not in self.rda_names:
                merged[name] = mean
                continue
            radius = sum(a.weight * scales.get(k, 1.0) * a.norms[name] for k, a in active.items()) / total
            direction = self.directions[name].div(total)
            length = float(torch.linalg.vector_norm(direction))
            if length < self.eps:  # directions cancel: the mean is the honest answer (and ~0)
                merged[name], fallbacks = mean, fallbacks + 1
            else:
                merged[name] = direction.mul_(radius / length)
        return self._finish(merged, active, total, scales, fallbacks)

    def _finish(
        self,
        merged: dict[str, Tensor],
        active: Mapping[str, AnswerNorms],
        total: float,
        scales: Mapping[str, float],
        fallbacks: int,
    ) -> Finalized:
        mean_delta_norm = (
            sum(a.weight * scales.get(k, 1.0) * a.global_norm for k, a in active.items()) / total
        )
        merged_norm = math.sqrt(sum(float(torch.linalg.vector_norm(t)) ** 2 for t in merged.values()))
        stats = {
            "merged_norm": merged_norm,
            "mean_delta_norm": mean_delta_norm,
            "ratio": merged_norm / mean_delta_norm if mean_delta_norm > 0 else 0.0,
            "fallbacks": float(fallbacks),
            "learners": float(len(active)),
        }
        return Finalized(merged, stats, dict(scales))


def _scaled(t: Tensor, s: float) -> Tensor:
    """`t` in fp32 times `s`, as a fresh tensor (exactly `t` when s is 1)."""
    return t.to(torch.float32) * s if s != 1.0 else t.to(torch.float32, copy=True)
