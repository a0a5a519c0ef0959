"""The syncer's merge of learner outer gradients and its outer optimizer (pure tensor code, no I/O).

A round of fragment p collects outer gradients ``Δ_m = Θ_base - θ_{m,p}`` from the learners that answered
(each against the version it trained from: ``ddiloco.syncer.fragment``), merges them into one outer gradient
and applies one outer Nesterov step to the global ``Θ_p``.
Design choices:

- Weights ``w_m = c_tokens² / c_steps`` ("quantity × quality", DESIGN.md §2): a learner that processed more
  tokens in fewer (hence larger-batch) steps counts more; a learner without steps counts 0.
- RDA, radial-directional averaging, per tensor (per fragment member: a row piece of a split tensor counts
  as a tensor, see `ddiloco.fragments`): ``(Σ w‖Δ_m‖ / Σ w) · φ(Σ w φ(Δ_m) / Σ w)``, φ(x) = x/‖x‖.
  The plain mean of M nearly orthogonal deltas shrinks by ~1/√M, silently lowering the outer learning rate
  as learners are added; RDA keeps the mean *length* and averages only *directions*. When the mean
  direction degenerates (opposite deltas cancel: ‖Σ w φ(Δ_m)‖ < eps) it falls back to the weighted mean,
  which is then tiny or zero, as it should be. Embedding-like tensors (sparse, per-token rows) always use
  the weighted mean: rows touched by one learner only must not be rescaled by the others' norms.
- Staleness discount ``(1 + s)^-a`` (`staleness_discount`): the polynomial staleness function of FedAsync
  (Xie, Koyejo, Gupta 2019, "Asynchronous Federated Optimization", a = 0.5 there and here by default);
  how the syncer applies it is `ddiloco.syncer.fragment`'s to say. Exactly 1.0 for a fresh answer, so
  rounds without stale answers are bit-for-bit what they were without it.
- Exactness where it is cheap: one learner with positive weight gives back exactly its delta (RDA and mean),
  and ``OuterNesterov`` reproduces ``torch.optim.SGD(nesterov=True)`` operation by operation.
- Speed (the syncer merges every fragment every round on a CPU): each learner's norm is one streaming
  reduction, the weighted sum runs in chunks that stay in cache (each input read once, the output written
  once), the Nesterov step does its four element-wise passes chunk by chunk, and ``out=`` buffers let the
  caller avoid fresh large allocations, whose first-touch page faults cost more than the arithmetic.
"""

from __future__ import annotations

import math
from collections.abc import Container, Mapping, Sequence

import torch
from torch import Tensor

from ddiloco.compression import all_finite

__all__ = [
    "OuterNesterov",
    "merge",
    "merge_with_stats",
    "rda",
    "staleness_discount",
    "token_weight",
    "weighted_mean",
]

METHODS = ("rda", "mean")
_CHUNK = 1 << 18  # elements per chunk: 1 MiB of fp32 per operand, so a chunk's operands stay in L2/L3


def token_weight(c_tokens: int, c_steps: int) -> float:
    """Merge weight of one answer: ``c_tokens² / c_steps`` (0.0 when the learner took no step)."""
    if c_tokens < 0 or c_steps < 0:
        raise ValueError(f"counters must be >= 0, got c_tokens={c_tokens}, c_steps={c_steps}")
    if c_steps == 0:
        return 0.0
    return float(c_tokens) ** 2 / float(c_steps)


def staleness_discount(staleness: int, exponent: float) -> float:
    """How much an answer ``staleness`` versions behind counts: ``(1 + s)^-a`` (1.0 exactly when fresh)."""
    if staleness < 0 or not (math.isfinite(exponent) and exponent >= 0):
        raise ValueError(f"staleness must be >= 0 and exponent finite and >= 0, got {staleness}, {exponent}")
    if staleness == 0 or exponent == 0:
        return 1.0
    return float(1 + staleness) ** -exponent


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


class OuterNesterov:
    """Outer Nesterov SGD over named fp32 tensors, one momentum buffer per tensor (so per fragment).

    Reproduces ``torch.optim.SGD(params, lr, momentum, nesterov=True)`` with ``p.grad = outer_grad``: the
    buffer starts as a copy of the first gradient, then ``buf = m·buf + g``, ``p -= lr·(g + m·buf)``.
    It keeps names rather than parameter objects so its state saves as a flat safetensors dict and a step
    can touch one fragment without the others.

    Schedule-aware momentum (`lr_scale`): an outer gradient is a sum of inner steps, so it carries the inner
    learning rate η it was trained at (Δ ≈ η·ĝ), and a plain buffer keeps old rates: when the inner rate
    decays, a buffer filled at the peak rate keeps moving the model as far as before, and the annealing the
    learners do never reaches the global model. torch's SGD with an LR schedule keeps gradients in its buffer
    and multiplies by the *current* rate; the same rule on ĝ = Δ/η is ``buf = m·(η_k/η_{k−1})·buf + Δ``,
    ``p -= lr·(Δ + m·buf)``: the buffer is kept in Δ units at the latest scale (`lr_scale`, saved with the
    momentum) and rescaled when the scale changes. With a constant scale (the default 1.0 on every step) it
    is the plain rule above, bit for bit.
    """

    def __init__(self, lr: float = 0.7, momentum: float = 0.9) -> None:
        if not (math.isfinite(lr) and lr > 0):
            raise ValueError(f"outer lr must be finite and > 0, got {lr}")
        if not (0.0 <= momentum < 1.0):
            raise ValueError(f"outer momentum must be in [0, 1), got {momentum}")
        self.lr = float(lr)
        self.momentum = float(momentum)
        self._buf: dict[str, Tensor] = {}
        self.lr_scale: float | None = None
        """The inner-rate scale η the buffer is expressed at (None: not known, taken as the next step's)."""

    def step(
        self, params: dict[str, Tensor], outer_grad: Mapping[str, Tensor], lr_scale: float = 1.0
    ) -> None:
        """Update ``params`` (contiguous fp32, in place) with ``outer_grad`` (same names and shapes), trained at
        inner-rate scale ``lr_scale`` (class docstring: the buffer is rescaled from its own scale to it)."""
        if not (math.isfinite(lr_scale) and lr_scale >= 0):
            raise ValueError(f"outer step: lr_scale must be finite and >= 0, got {lr_scale}")
        if set(params) != set(outer_grad):
            missing, extra = sorted(set(params) - set(outer_grad)), sorted(set(outer_grad) - set(params))
            raise ValueError(f"outer step: outer_grad lacks {missing} and has unknown {extra}")
        for name, p in params.items():
            g = outer_grad[name]
            if p.dtype != torch.float32 or not p.is_contiguous():
                raise ValueError(f"outer step: parameter {name!r} must be a contiguous float32 tensor")
            if not isinstance(g, Tensor) or g.shape != p.shape:
                raise ValueError(
                    f"outer step: outer_grad[{name!r}] does not match parameter shape {list(p.shape)}"
                )
            buf = self._buf.get(name)
            if buf is not None and buf.shape != p.shape:
                raise ValueError(
                    f"outer step: momentum for {name!r} has shape {list(buf.shape)}, parameter {list(p.shape)}"
                )
        m, lr = self.momentum, self.lr
        prev = self.lr_scale
        decay = m * (lr_scale / prev) if prev is not None and prev > 0 else m  # the buffer's m·(η_k/η_{k−1})
        self.lr_scale = float(lr_scale)
        for name, p in params.items():
            g = outer_grad[name].to(torch.float32).reshape(-1)  # (numel,)
            buf = self._buf.get(name)
            if buf is None:  # torch: momentum_buffer = clone(grad) on the first step, no update
                self._buf[name] = buf = g.clone().view(p.shape)
                first = True
            else:
                first = False
            bflat, pflat = buf.view(-1), p.view(-1)
            scratch = torch.empty(min(_CHUNK, pflat.numel()), dtype=torch.float32, device=p.device)
            for s in range(0, pflat.numel(), _CHUNK):
                gc, bc, pc = g[s : s + _CHUNK], bflat[s : s + _CHUNK], pflat[s : s + _CHUNK]
                if not first:
                    bc.mul_(decay).add_(gc)
                d = torch.add(gc, bc, alpha=m, out=scratch[: gc.numel()])  # g + m·buf
                pc.add_(d, alpha=-lr)

    def state_dict(self) -> dict[str, Tensor]:
        """Momentum buffers by parameter name (the live tensors, as torch optimizers do; fp32)."""
        return dict(self._buf)

    def load_state_dict(self, state: Mapping[str, Tensor]) -> None:
        """Replace the momentum buffers; shapes are checked against the parameters at the next step."""
        loaded: dict[str, Tensor] = {}
        for name, t in state.items():
            if not isinstance(name, str) or not isinstance(t, Tensor) or not t.is_floating_point():
                raise ValueError(f"outer state: entry {name!r} must map a name to a floating-point tensor")
            if not all_finite(t):
                raise ValueError(f"outer state: momentum for {name!r} holds NaN/Inf values")
            loaded[name] = t.detach().to(torch.float32).clone().contiguous()
        self._buf = loaded
