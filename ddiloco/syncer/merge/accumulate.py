"""A round's merge as running sums: each answer is added as it arrives, and the merge is a finalisation.

This is the syncer's merge (RDA or the plain mean per tensor, weighted as `ddiloco.syncer.merge.outer` says). A batch
merge of a round's M answers at once (the reference the tests hold this to, `tests/merge_reference.py`)
would hold M decoded fp32 copies of the fragment until quorum + grace; `RoundSums` keeps per tensor only
the sums the merge needs and per answer a few floats, so an open round costs one fragment-sized fp32 buffer
whatever M is. Answers are checked whole, then decoded chunk by chunk into the sums; robust clipping, RDA's
fallback and a single answer reread the answers (`reread`), and the robust merge (`trim`) merges from the
answers kept encoded. The result equals the batch merge up to fp32 summation order.

Design notes (why sums, how clipping stays exact, what a round's passes cost): docs/internals.md,
"A round's merge as running sums".
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Container, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from ddiloco.codec.base import chunk_buffer, norm64
from ddiloco.codec.encoded import HINT_RTOL, EncodedTensor
from ddiloco.codec.float import FP32
from ddiloco.syncer.merge.bufferpool import BufferPool
from ddiloco.syncer.merge.outer import METHODS
from ddiloco.syncer.merge.robust import MIN_ANSWERS, trimmed_merge

Tensors = Mapping[str, Tensor]


class Reread(Protocol):
    """Reads an answer's outer gradient again by the key it was added under (clipping, single answers);
    into `out` (per tensor, contiguous fp32) when given, so a single answer lands in a pooled buffer
    instead of fresh memory (~0.1 s of page faults per 193 MB); the result may then be `out` itself."""

    def __call__(self, key: str, out: Mapping[str, Tensor] | None = None) -> Tensors: ...


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
    """The merge times the scale `RoundSums.finalize` was given."""
    stats: dict[str, float]
    """merged_norm (global L2 norm of the merge), mean_delta_norm (weighted mean of the answers' global
    norms), ratio (merged / mean: ≈1 for RDA, ≈1/√M for the plain mean of independent deltas), fallbacks
    (tensors where RDA fell back to the mean), learners (answers with positive weight); merged_norm and
    ratio are of the scaled merge."""
    clipped: dict[str, float]
    """Answer key -> the scale robust clipping applied to it (clipped answers only)."""
    flat: Tensor | None = None
    """The buffer `merged` is carved from, when it came from a pool (`RoundSums.recycle`)."""


class RoundSums:
    """The running sums of one round of one fragment (see the module docstring)."""

    def __init__(
        self,
        shapes: Mapping[str, torch.Size | tuple[int, ...]],
        *,
        method: str = "rda",
        embedding_names: Container[str] = frozenset(),
        eps: float = 1e-6,
        pool: BufferPool | None = None,
        trim: float | None = None,
    ) -> None:
        """`pool`: where the sums' buffer comes from and where `release` gives it back (None: allocate).
        `trim`: the robust merge's β (`ddiloco.syncer.merge.robust`): the answers are kept encoded and a round of 3 or
        more merges as their coordinate-wise trimmed mean (None: off, nothing kept)."""
        if method not in METHODS:
            raise ValueError(f"unknown merge method {method!r}; expected one of {', '.join(METHODS)}")
        self.eps = eps
        self.shapes = {n: torch.Size(s) for n, s in shapes.items()}
        self.rda_names = frozenset(n for n in self.shapes if method == "rda" and n not in embedding_names)
        self.pool = pool
        self._flat = _take(pool, sum(s.numel() for s in self.shapes.values()))
        self._unwritten = set(self.shapes)
        """Tensors no answer has written yet: their sum is 0 whatever the buffer holds (the first answer
        overwrites it, so the buffer is never zeroed: a pass over the fragment saved per round)."""
        self._views = _carve(self._flat, self.shapes)
        self.sums = {n: t for n, t in self._views.items() if n not in self.rda_names}
        self.directions = {n: t for n, t in self._views.items() if n in self.rda_names}
        self.answers: dict[str, AnswerNorms] = {}
        self.corrections = 0
        """RDA tensors of answers whose claimed norm was wrong, so their direction took a second pass."""
        self.unclaimed = 0
        """RDA tensors of answers that claimed no usable norm (none, or one outside what the scales allow),
        so it was measured in a pass of its own."""
        self._buf = chunk_buffer()
        self.trim = trim
        self.kept: dict[str, dict[str, EncodedTensor]] = {}
        """With `trim`: the answers of positive weight as added (encoded: int4 ~0.53 byte per value)."""

    def __len__(self) -> int:
        return len(self.answers)

    def release(self) -> None:
        """The round is over: give the sums' buffer back to the pool (the sums must not be used after)."""
        if self.pool is not None and self._flat.numel():
            self.pool.give(self._flat)
        self._flat = torch.empty(0)
        self._views, self.sums, self.directions, self.kept = {}, {}, {}, {}

    def recycle(self, done: Finalized) -> None:
        """`done.merged` is no longer used (the outer step consumed it): its buffer goes back to the pool."""
        if self.pool is not None and done.flat is not None:
            self.pool.give(done.flat)

    def nbytes(self) -> int:
        """Bytes held by the sums (what an open round costs)."""
        return sum(t.numel() * 4 for t in (*self.sums.values(), *self.directions.values()))

    def add(self, key: str, weight: float, delta: Tensors) -> AnswerNorms:
        """Add answer `key`: its outer gradient Δ as fp32 tensors (every tensor of the fragment) and its
        merge weight."""
        self._check_names(key, delta)
        encoded = {}
        for name, t in delta.items():
            if not isinstance(t, Tensor) or not t.is_floating_point() or t.shape != self.shapes[name]:
                raise ValueError(
                    f"answer {key!r}: {name} must be a float tensor of shape {list(self.shapes[name])}"
                )
            try:
                encoded[name] = EncodedTensor.check(
                    {"data": t.detach().float().reshape(-1)}, FP32.name, t.shape
                )
            except ValueError as e:
                raise ValueError(f"answer {key!r}: {name}: {e}") from None
        return self.add_encoded(key, weight, encoded)

    def add_encoded(
        self,
        key: str,
        weight: float,
        delta: Mapping[str, EncodedTensor],
        claimed: Mapping[str, float] | None = None,
    ) -> AnswerNorms:
        """Add answer `key` as checked encoded tensors (`EncodedTensor.check`). `claimed`: the learner's
        norms per tensor (header `norms`), used to add RDA directions in one pass; anything unusable in it
        is ignored (the norm is then measured first)."""
        if key in self.answers:
            raise ValueError(f"answer {key!r} was added to this round already")
        if not (math.isfinite(weight) and weight >= 0):
            raise ValueError(f"weight of {key!r} is {weight}; merge weights must be finite and >= 0")
        self._check_names(key, delta)
        for name, t in delta.items():
            if t.shape != self.shapes[name]:
                raise ValueError(
                    f"answer {key!r}: {name} has shape {list(t.shape)}, expected {list(self.shapes[name])}"
                )
        norms = {}
        for name, t in delta.items():
            if weight == 0:
                norms[name] = t.norm(self._buf)
            elif name not in self.rda_names:
                norms[name] = self._write(name, t, weight)
            else:
                norms[name] = self._add_direction(name, weight, t, _claim(claimed, name))
        self.answers[key] = answer = AnswerNorms(float(weight), norms)
        if self.trim is not None and weight > 0:
            self.kept[key] = dict(delta)
        return answer

    def _check_names(self, key: str, delta: Mapping[str, object]) -> None:
        if set(delta) != set(self.shapes):
            missing, extra = sorted(set(self.shapes) - set(delta)), sorted(set(delta) - set(self.shapes))
            raise ValueError(f"answer {key!r} lacks tensors {missing} and has unknown {extra}")

    def _write(self, name: str, t: EncodedTensor, alpha: float) -> float:
        """Add alpha·t to `name`'s sum, overwriting it if no answer wrote it yet; returns ‖t‖."""
        norm = t.accumulate(self._views[name], alpha, self._buf, overwrite=name in self._unwritten)
        self._unwritten.discard(name)
        return norm

    def _add_direction(self, name: str, weight: float, t: EncodedTensor, claim: float | None) -> float:
        if t.known_norm is not None:  # measured by this syncer (its check, or an intake reader)
            if t.known_norm > 0:
                self._write(name, t, weight / t.known_norm)
            return t.known_norm
        if claim is None or not t.plausible(claim):
            self.unclaimed += 1
            norm = t.norm(self._buf)
            if norm > 0:
                self._write(name, t, weight / norm)
            return norm
        norm = self._write(name, t, weight / claim)
        if abs(norm - claim) > HINT_RTOL * claim:  # the claim was wrong: add the difference of coefficients
            self.corrections += 1
            t.accumulate(
                self.directions[name], (weight / norm if norm > 0 else 0.0) - weight / claim, self._buf
            )
        return norm

    def clip_scales(self, factor: float | None) -> dict[str, float]:
        """Answer key -> scale, for the answers robust clipping scales down (`validation.clip_outliers`)."""
        if factor is None or len(self.answers) < 2:
            return {}
        norms = {k: a.global_norm for k, a in self.answers.items()}
        bound = factor * statistics.median(norms.values())
        return {k: bound / n for k, n in norms.items() if n > bound and n > 0}

    def finalize(
        self, reread: Reread, robust_clip: float | None = None, scale: float = 1.0, plain: bool = False
    ) -> Finalized:
        """`scale` times the merged outer gradient of the answers added so far (fp32, in a buffer of the
        pool when there is one) and its stats, norms taken of the scaled result. The scale is applied in
        the pass that writes the result, so a caller's sign flip or damping costs no pass of its own.
        `plain`: the weighted mean for every tensor, RDA's too (their answers read again, as RDA's fallback
        does): the learners' weighted mean, which RDA's restored radius exceeds by 1/cos of their spread."""
        active = {k: a for k, a in self.answers.items() if a.weight > 0}
        if not active:
            raise ValueError("all merge weights are 0 (no answering learner took a step); nothing to merge")
        for name in self._unwritten:  # no answer wrote it (zero weights or norms): its sum is 0
            self._views[name].zero_()
        self._unwritten.clear()
        total = sum(a.weight for a in active.values())
        scales = self.clip_scales(robust_clip)
        flat = _take(self.pool, self._flat.numel())
        out = _carve(flat, self.shapes)
        if len(active) == 1:
            [(key, answer)] = active.items()
            s = scales.get(key, 1.0) * scale
            merged = {n: _into(out[n], t, s) for n, t in reread(key, out).items()}
            return self._finish(merged, active, total, scales, 0, flat if self.pool else None)
        if self.trim is not None and len(active) >= MIN_ANSWERS:
            return self._trimmed(active, total, scales, scale, plain, out, flat)
        fallbacks = 0
        # a clipped answer polluted the plain sums (S_t holds w·Δ at its full norm): those means are summed
        # again from the answers read again, clipped as they are added (module docstring)
        polluted = list(self.sums) if any(k in active for k in scales) else []
        merged = (
            {} if polluted else {n: torch.mul(t, scale / total, out=out[n]) for n, t in self.sums.items()}
        )
        from_answers, norms = [*polluted, *(self.rda_names if plain else ())], {}
        for name in () if plain else self.rda_names:
            radius = sum(a.weight * scales.get(k, 1.0) * a.norms[name] for k, a in active.items()) / total
            length = norm64(self.directions[name]) / total
            if length < self.eps:  # directions cancel: the mean is the honest answer (and ~0)
                from_answers.append(name)
            else:
                coef = scale * radius / (length * total)
                merged[name] = torch.mul(self.directions[name], coef, out=out[name])
                norms[name] = abs(scale) * radius  # ‖D · coef‖, without another pass over the result
        if from_answers:  # the means are summed in the result's own (pooled) buffers: no fragment-sized copy
            for name, mean in self._means(from_answers, active, scales, total, reread, out).items():
                merged[name] = mean.mul_(scale)
            fallbacks = 0 if plain else len(from_answers) - len(polluted)
        return self._finish(merged, active, total, scales, fallbacks, flat if self.pool else None, norms)

    def _trimmed(
        self,
        active: Mapping[str, AnswerNorms],
        total: float,
        scales: Mapping[str, float],
        scale: float,
        plain: bool,
        out: Mapping[str, Tensor],
        flat: Tensor,
    ) -> Finalized:
        """The robust merge of ≥ 3 answers from the kept encoded answers (`ddiloco.syncer.merge.robust`)."""
        merged, fallbacks, norms, k = trimmed_merge(
            {key: self.kept[key] for key in active},
            {key: a.weight for key, a in active.items()},
            {key: a.norms for key, a in active.items()},
            scales,
            out,
            frozenset() if plain else self.rda_names,
            trim=self.trim or 0.0,
            scale=scale,
            eps=self.eps,
            buf=self._buf,
        )
        done = self._finish(merged, active, total, scales, fallbacks, flat if self.pool else None, norms)
        done.stats["trimmed"] = float(k)
        return done

    def _means(
        self,
        names: list[str],
        active: Mapping[str, AnswerNorms],
        scales: Mapping[str, float],
        total: float,
        reread: Reread,
        out: Mapping[str, Tensor],
    ) -> dict[str, Tensor]:
        """The (clipped) weighted mean of tensors, from the answers read again (RDA's rare fallback, the plain
        means of a round that clipped an answer, every tensor of a closing merge), summed into `out`'s
        tensors."""
        means = {n: out[n].zero_() for n in names}
        for key, a in active.items():
            delta = reread(key)
            for n in names:
                means[n].add_(delta[n], alpha=a.weight * scales.get(key, 1.0))
        return {n: t.div_(total) for n, t in means.items()}

    def _finish(
        self,
        merged: dict[str, Tensor],
        active: Mapping[str, AnswerNorms],
        total: float,
        scales: Mapping[str, float],
        fallbacks: int,
        flat: Tensor | None = None,
        norms: Mapping[str, float] | None = None,
    ) -> Finalized:
        """`norms`: tensors of `merged` whose norm is known already (RDA's radius)."""
        mean_delta_norm = (
            sum(a.weight * scales.get(k, 1.0) * a.global_norm for k, a in active.items()) / total
        )
        known = norms or {}
        merged_norm = math.sqrt(sum((known[n] if n in known else norm64(t)) ** 2 for n, t in merged.items()))
        stats = {
            "merged_norm": merged_norm,
            "mean_delta_norm": mean_delta_norm,
            "ratio": merged_norm / mean_delta_norm if mean_delta_norm > 0 else 0.0,
            "fallbacks": float(fallbacks),
            "learners": float(len(active)),
        }
        return Finalized(merged, stats, dict(scales), flat)


def _into(dst: Tensor, t: Tensor, s: float) -> Tensor:
    """`t` times `s` in `dst`, in one pass (exactly `t` when s is 1, -t when s is -1; `t` may be `dst`)."""
    if t.data_ptr() == dst.data_ptr():
        return dst.mul_(s) if s != 1.0 else dst
    return dst.copy_(t) if s == 1.0 else torch.mul(t, s, out=dst)


def _claim(claimed: Mapping[str, float] | None, name: str) -> float | None:
    """A usable claimed norm for `name` (finite, > 0), else None."""
    v = claimed.get(name) if isinstance(claimed, Mapping) else None
    if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v > 0:
        return float(v)
    return None


def _take(pool: BufferPool | None, numel: int) -> Tensor:
    return pool.take(numel) if pool is not None else torch.empty(numel, dtype=torch.float32)


def _carve(flat: Tensor, shapes: Mapping[str, torch.Size]) -> dict[str, Tensor]:
    """Per-tensor views of one flat buffer, in the order of `shapes`."""
    views, at = {}, 0
    for n, s in shapes.items():
        views[n] = flat[at : at + s.numel()].view(s)
        at += s.numel()
    return views
