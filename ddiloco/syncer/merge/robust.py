"""The robust merge (`diloco.robust_merge: trimmed_mean`): a coordinate-wise trimmed mean of a round's answers.

For a round with n ≥ 3 answers of positive weight, at every coordinate the n values (each answer's Δ, clipped
first when `diloco.robust_clip` is on) are sorted and the k = max(1, ⌊β·n⌋) smallest and k largest dropped
(β = `diloco.robust_trim`, k ≤ (n−1)/2); the merge is the token-weighted mean of the values kept. Trimming is
by count, not by weight: a weight is a claim, and a hostile answer must not buy its way out of the trim.
RDA tensors keep RDA's length: the trimmed mean's direction at the trimmed weighted mean of the answers'
norms (also k dropped from each side), so a clean round steps about as far as RDA; the closing merge
(`plain`) and mean tensors take the trimmed mean itself. With fewer than 3 answers nothing can be outvoted
and the merge is the usual one. Memory: the round keeps its answers encoded (int4: ~0.53 byte per value and
answer) and decodes them chunk by chunk, so a finalise needs M × CHUNK values beside the result.
Why, and what it does not bound (a majority of hostile answers): docs/operations.md "Robust merge".
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from ddiloco.codec.base import norm64
from ddiloco.codec.encoded import EncodedTensor

CHUNK = 1 << 16
"""Coordinates per chunk: M answers × CHUNK values sorted at once (16 answers: 4 MiB of values, ~24 MiB of
sort outputs and indices)."""
TRIMMED_MEAN = "trimmed_mean"
ROBUST_MERGES = (TRIMMED_MEAN,)
MIN_ANSWERS = 3


def trim_count(n: int, trim: float) -> int:
    """Values dropped from each side of n: at least one once n ≥ 3, at most (n−1)//2 (one value kept)."""
    if n < MIN_ANSWERS:
        return 0
    return min(max(1, math.floor(trim * n)), (n - 1) // 2)


def trimmed_weighted_mean(values: Sequence[float], weights: Sequence[float], k: int) -> float:
    """The weighted mean of `values` without their k smallest and k largest (ties broken by position)."""
    order = sorted(range(len(values)), key=lambda i: values[i])[k : len(values) - k]
    total = sum(weights[i] for i in order)
    return sum(weights[i] * values[i] for i in order) / total if total > 0 else 0.0


def trimmed_mean_into(
    out: Tensor,
    answers: Sequence[EncodedTensor],
    alphas: Sequence[float],
    weights: Sequence[float],
    k: int,
    buf: Tensor | None = None,
) -> Tensor:
    """Coordinate-wise trimmed mean of `answers` (each times its alpha, the clip scale) weighted by `weights`
    into `out` (contiguous fp32 of their shape), chunk by chunk (module docstring)."""
    n, flat = len(answers), out.view(-1)
    numel = flat.numel()
    total = sum(weights)
    w = torch.tensor([x / total for x in weights], dtype=torch.float32)  # normalized: fp32 keeps its range
    rows = torch.empty(n, min(CHUNK, numel), dtype=torch.float32)
    for s in range(0, numel, CHUNK):
        c = min(CHUNK, numel - s)
        for m, (t, a) in enumerate(zip(answers, alphas, strict=True)):
            t.decode_range(rows[m, :c], s, a, buf)
        values, order = torch.sort(
            rows[:, :c], dim=0, stable=True
        )  # (n, c): the answers' values per coordinate, sorted
        kept, kept_w = values[k : n - k], w[order[k : n - k]]
        num = kept.mul_(kept_w).sum(dim=0)
        torch.div(num, kept_w.sum(dim=0), out=flat[s : s + c])
    return out


def trimmed_merge(
    answers: Mapping[str, Mapping[str, EncodedTensor]],
    weights: Mapping[str, float],
    norms: Mapping[str, Mapping[str, float]],
    scales: Mapping[str, float],
    out: Mapping[str, Tensor],
    rda_names: frozenset[str],
    *,
    trim: float,
    scale: float = 1.0,
    eps: float = 1e-6,
    buf: Tensor | None = None,
) -> tuple[dict[str, Tensor], int, dict[str, float], int]:
    """`scale` × the trimmed merge of ≥ 3 answers (key -> tensors, all with positive weight) into `out`:
    `norms` per answer and tensor (unclipped), `scales` the clip scales (missing: 1), `rda_names` the tensors
    whose length follows RDA's (none for a closing merge). Returns (merged, fallbacks, known norms, k): an
    RDA tensor whose trimmed mean is below `eps` × its radius keeps the trimmed mean (a fallback)."""
    keys = sorted(answers)
    k = trim_count(len(keys), trim)
    ws = [weights[key] for key in keys]
    alphas = [scales.get(key, 1.0) for key in keys]
    merged, known, fallbacks = {}, {}, 0
    for name, dst in out.items():
        mean = trimmed_mean_into(dst, [answers[key][name] for key in keys], alphas, ws, k, buf)
        if name not in rda_names:
            merged[name] = mean.mul_(scale) if scale != 1.0 else mean
            continue
        radius = trimmed_weighted_mean(
            [a * norms[key][name] for key, a in zip(keys, alphas, strict=True)], ws, k
        )
        length = norm64(mean)
        if length <= eps * radius or radius == 0:
            fallbacks += 1
            merged[name] = mean.mul_(scale)
        else:
            merged[name] = mean.mul_(scale * radius / length)
            known[name] = abs(scale) * radius
    return merged, fallbacks, known, k
