"""The batch merge: every answer of a round at once, the reference `ddiloco.syncer.merge.accumulate.RoundSums` (what the
syncer runs: running sums, one answer at a time) is held against in the tests, and what the benchmarks that
study RDA itself (`benchmarks/rda_pieces.py`) call. Same maths as `ddiloco.syncer.merge.outer`'s docstring describes:
RDA ``(Σ w‖Δ_m‖/Σ w) · φ(Σ w φ(Δ_m)/Σ w)`` per tensor, the weighted mean for embedding-like tensors or
``method="mean"``; one learner with positive weight gives back exactly its delta."""

from __future__ import annotations

import math
from collections.abc import Container, Mapping, Sequence

import torch
from torch import Tensor

from ddiloco.syncer.merge.outer import METHODS

_CHUNK = 1 << 18


def _normalized(weights: Sequence[float], n: int) -> list[float]:
    """Validate merge weights and divide them by their sum."""
    if len(weights) != n:
        raise ValueError(f"got {len(weights)} weights for {n} deltas")
    ws = [float(w) for w in weights]
    for i, w in enumerate(ws):
        if not math.isfinite(w) or w < 0:
            raise ValueError(f"weight {i} is {w}; merge weights must be finite and >= 0")
    total = sum(ws)
    if not total > 0:
        raise ValueError("all merge weights are 0 (no answering learner took a step); nothing to merge")
    return [w / total for w in ws]


def _check_same(tensors: Sequence[Tensor], what: str) -> torch.Size:
    if len(tensors) == 0:
        raise ValueError(f"{what}: nothing to merge (no deltas)")
    shape = tensors[0].shape
    for i, t in enumerate(tensors):
        if not isinstance(t, Tensor) or not t.is_floating_point():
            raise ValueError(f"{what}: delta {i} is not a floating-point tensor")
        if t.shape != shape:
            raise ValueError(f"{what}: delta {i} has shape {list(t.shape)}, delta 0 has {list(shape)}")
    return shape


def _out_buffer(out: Tensor | None, shape: torch.Size, device: torch.device) -> Tensor:
    if out is None:
        return torch.empty(shape, dtype=torch.float32, device=device)
    if out.dtype != torch.float32 or out.shape != shape or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous float32 tensor of shape {list(shape)}")
    return out


def _weighted_sum(tensors: Sequence[Tensor], coeffs: Sequence[float], out: Tensor) -> Tensor:
    """``out = Σ coeffs[i] * tensors[i]`` chunk by chunk: each input read once, ``out`` written once."""
    pairs = [(t.reshape(-1), c) for t, c in zip(tensors, coeffs, strict=True) if c != 0.0]
    flat = out.view(-1)  # (numel,)
    if not pairs:
        return out.zero_()
    for s in range(0, flat.numel(), _CHUNK):
        acc = flat[s : s + _CHUNK].zero_()  # then add_ (fp32 math) even for bf16 inputs; mul(out=) is not
        for t, c in pairs:
            acc.add_(t[s : s + _CHUNK], alpha=c)
    return out


def _norm(t: Tensor) -> float:
    return float(torch.linalg.vector_norm(t, dtype=torch.float32 if t.dtype != torch.float32 else None))


def _mean(tensors: Sequence[Tensor], wbar: Sequence[float], out: Tensor | None) -> Tensor:
    active = [(t, w) for t, w in zip(tensors, wbar, strict=True) if w > 0]
    res = _out_buffer(out, tensors[0].shape, tensors[0].device)
    if len(active) == 1:  # exact identity, no 1.0 * x rounding
        return res.copy_(active[0][0])
    return _weighted_sum([t for t, _ in active], [w for _, w in active], res)


def _rda(
    tensors: Sequence[Tensor], wbar: Sequence[float], norms: Sequence[float], eps: float, out: Tensor | None
) -> tuple[Tensor, bool]:
    """RDA of one tensor given normalized weights and the inputs' norms; returns (result, fell_back)."""
    active = [(t, w, n) for t, w, n in zip(tensors, wbar, norms, strict=True) if w > 0]
    res = _out_buffer(out, tensors[0].shape, tensors[0].device)
    for _, _, n in active:
        if not math.isfinite(n):
            raise ValueError("a delta holds NaN/Inf values (its norm is not finite)")
    if len(active) == 1:  # exact identity: radius * φ(Δ) would round
        return res.copy_(active[0][0]), False
    radius = sum(w * n for _, w, n in active)  # Σ w‖Δ‖ / Σ w (weights already normalized)
    coeffs = [w / n if n > 0 else 0.0 for _, w, n in active]  # zero deltas: no direction to contribute
    _weighted_sum([t for t, _, _ in active], coeffs, res)  # mean direction, ‖·‖ ≤ 1
    length = float(torch.linalg.vector_norm(res))
    if length < eps:  # directions cancel: the mean is the honest answer (and ~0)
        return _weighted_sum([t for t, _, _ in active], [w for _, w, _ in active], res), True
    return res.mul_(radius / length), False


def weighted_mean(deltas: Sequence[Tensor], weights: Sequence[float], *, out: Tensor | None = None) -> Tensor:
    """``Σ w Δ_m / Σ w`` in fp32 (into ``out`` when given)."""
    _check_same(deltas, "weighted_mean")
    return _mean(deltas, _normalized(weights, len(deltas)), out)


def rda(
    deltas: Sequence[Tensor], weights: Sequence[float], *, eps: float = 1e-6, out: Tensor | None = None
) -> Tensor:
    """Radial-directional average ``(Σ w‖Δ_m‖/Σ w) · φ(Σ w φ(Δ_m)/Σ w)`` of same-shape tensors, in fp32.

    Norms are over the whole tensor. Zero deltas add no direction (but do count, with length 0, in the
    radius). Falls back to ``weighted_mean`` when the mean direction's norm is below ``eps``. The mean
    direction has norm in [0, 1] and fp32 rounding leaves ~1e-7 of noise in it (exactly opposite deltas
    give ~3e-8, not 0, because the fused multiply-add rounds differently per term), so ``eps`` must sit
    above that: with 1e-6 a direction that survives is accurate to a few percent or better.
    """
    _check_same(deltas, "rda")
    wbar = _normalized(weights, len(deltas))
    norms = [_norm(t) if w > 0 else 0.0 for t, w in zip(deltas, wbar, strict=True)]
    return _rda(deltas, wbar, norms, eps, out)[0]


def merge(
    deltas: Sequence[Mapping[str, Tensor]],
    weights: Sequence[float],
    *,
    embedding_names: Container[str] = frozenset(),
    method: str = "rda",
    eps: float = 1e-6,
    out: Mapping[str, Tensor] | None = None,
) -> dict[str, Tensor]:
    """Merge per-learner fragment deltas (name -> tensor) into one fp32 outer gradient.

    ``method`` "rda" or "mean" applies to non-embedding tensors; names in ``embedding_names`` always use the
    weighted mean. ``out`` maps names to fp32 buffers to write into (reused across rounds by the syncer).
    """
    return _merge(deltas, weights, embedding_names, method, eps, out, stats=False)[0]


def merge_with_stats(
    deltas: Sequence[Mapping[str, Tensor]],
    weights: Sequence[float],
    *,
    embedding_names: Container[str] = frozenset(),
    method: str = "rda",
    eps: float = 1e-6,
    out: Mapping[str, Tensor] | None = None,
) -> tuple[dict[str, Tensor], dict[str, float]]:
    """``merge`` plus diagnostics for metrics and ablations.

    Stats: ``merged_norm`` (global L2 norm of the merged outer gradient), ``mean_delta_norm`` (weighted
    mean of the learners' global L2 norms), ``ratio`` = merged / mean (≈1 for RDA, ≈1/√M for the plain mean
    of independent deltas; 0.0 when every delta is zero), ``fallbacks`` (tensors where RDA degenerated to
    the mean) and ``learners`` (answers with positive weight).
    """
    merged, stats = _merge(deltas, weights, embedding_names, method, eps, out, stats=True)
    assert stats is not None
    return merged, stats


def _merge(
    deltas: Sequence[Mapping[str, Tensor]],
    weights: Sequence[float],
    embedding_names: Container[str],
    method: str,
    eps: float,
    out: Mapping[str, Tensor] | None,
    *,
    stats: bool,
) -> tuple[dict[str, Tensor], dict[str, float] | None]:
    if method not in METHODS:
        raise ValueError(f"unknown merge method {method!r}; expected one of {', '.join(METHODS)}")
    if len(deltas) == 0:
        raise ValueError("merge: nothing to merge (no deltas)")
    wbar = _normalized(weights, len(deltas))
    names = list(deltas[0].keys())
    for i, d in enumerate(deltas[1:], start=1):
        if set(d.keys()) != set(names):
            missing, extra = sorted(set(names) - set(d)), sorted(set(d) - set(names))
            raise ValueError(
                f"merge: delta {i} differs from delta 0 in tensors (missing {missing}, extra {extra})"
            )
    if out is not None and set(out.keys()) != set(names):
        raise ValueError("merge: out must have exactly the tensors being merged")

    merged: dict[str, Tensor] = {}
    sq_norms = [0.0] * len(deltas)  # per learner: Σ over tensors of ‖Δ_{m,t}‖²
    merged_sq = 0.0
    fallbacks = 0
    for name in names:
        tensors = [d[name] for d in deltas]
        _check_same(tensors, f"merge[{name!r}]")
        use_rda = method == "rda" and name not in embedding_names
        norms = [0.0] * len(deltas)
        if use_rda or stats:
            norms = [_norm(t) if w > 0 else 0.0 for t, w in zip(tensors, wbar, strict=True)]
        buf = out[name] if out is not None else None
        if use_rda:
            merged[name], fell_back = _rda(tensors, wbar, norms, eps, buf)
            fallbacks += fell_back
        else:
            merged[name] = _mean(tensors, wbar, buf)
        if stats:
            sq_norms = [acc + n * n for acc, n in zip(sq_norms, norms, strict=True)]
            merged_sq += _norm(merged[name]) ** 2
    if not stats:
        return merged, None
    mean_delta_norm = sum(w * math.sqrt(s) for w, s in zip(wbar, sq_norms, strict=True))
    merged_norm = math.sqrt(merged_sq)
    return merged, {
        "merged_norm": merged_norm,
        "mean_delta_norm": mean_delta_norm,
        "ratio": merged_norm / mean_delta_norm if mean_delta_norm > 0 else 0.0,
        "fallbacks": float(fallbacks),
        "learners": float(sum(w > 0 for w in wbar)),
    }


def trimmed_merge(
    deltas: Sequence[Mapping[str, Tensor]],
    weights: Sequence[float],
    *,
    trim: float,
    embedding_names: Container[str] = frozenset(),
    method: str = "rda",
    plain: bool = False,
    eps: float = 1e-6,
) -> dict[str, Tensor]:
    """The robust merge (`ddiloco.syncer.merge.robust`) of ≥ 3 deltas of positive weight, all at once and in fp64: per
    coordinate, the k = min(max(1, ⌊trim·n⌋), (n−1)//2) smallest and largest values dropped and the rest
    averaged with their weights; RDA tensors (unless `plain`) rescaled to the trimmed weighted mean of the
    deltas' norms (k dropped from each side), unless that mean is below `eps` × it. Ties are broken by position (a stable sort)."""
    wbar = _normalized(weights, len(deltas))
    n = len(deltas)
    if n < 3 or min(wbar) <= 0:
        raise ValueError("trimmed_merge: needs 3 or more deltas, all of positive weight")
    k = min(max(1, math.floor(trim * n)), (n - 1) // 2)
    w = torch.tensor(wbar, dtype=torch.float64)
    merged = {}
    for name in deltas[0]:
        stack = torch.stack([d[name].double() for d in deltas])
        values, order = torch.sort(stack, dim=0, stable=True)
        kept_w = w[order[k : n - k]]
        mean = (values[k : n - k] * kept_w).sum(0) / kept_w.sum(0)
        if method == "rda" and name not in embedding_names and not plain:
            norms = [float(d[name].double().norm()) for d in deltas]
            by_norm = sorted(range(n), key=lambda i: norms[i])[k : n - k]
            radius = sum(wbar[i] * norms[i] for i in by_norm) / sum(wbar[i] for i in by_norm)
            length = float(mean.norm())
            if radius > 0 and length > eps * radius:
                mean = mean * (radius / length)
        merged[name] = mean.float()
    return merged
