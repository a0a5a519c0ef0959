"""What a round's merge is weighted by, and the outer optimizer (pure tensor code, no I/O).

A round of fragment p collects outer gradients ``Δ_m = Θ_base - θ_{m,p}`` from the learners that answered
(each against the version it trained from), merges them into one (``ddiloco.syncer.merge.accumulate.RoundSums``) and
applies one outer Nesterov step to the global ``Θ_p`` (``OuterNesterov``, operation by operation
``torch.optim.SGD(nesterov=True)``). An answer weighs ``w_m = c_tokens² / c_steps`` (quantity × quality: more
tokens in fewer, larger-batch steps count more). RDA (radial-directional averaging) merges a tensor by mean
length and mean direction, because the plain mean of M nearly orthogonal deltas shrinks by ~1/√M;
embedding-like tensors take the weighted mean. Stale answers are discounted by ``(1 + s)^-a``
(`staleness_discount`, FedAsync's polynomial rule), exactly 1.0 for a fresh answer.

Design notes: docs/internals.md, "The merge and the outer step".
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import Tensor

from ddiloco.codec.base import all_finite

__all__ = ["METHODS", "OuterNesterov", "staleness_discount", "token_weight"]

METHODS = ("rda", "mean")
_CHUNK = 1 << 18  # elements per chunk of the Nesterov step: 1 MiB of fp32 per operand, in L2/L3


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


class OuterNesterov:
    """Outer Nesterov SGD over named fp32 tensors, one momentum buffer per tensor (so per fragment).

    Reproduces ``torch.optim.SGD(params, lr, momentum, nesterov=True)`` with ``p.grad = outer_grad``: the
    buffer starts as a copy of the first gradient, then ``buf = m·buf + g``, ``p -= lr·(g + m·buf)``.
    It keeps names rather than parameter objects so its state saves as a flat safetensors dict and a step
    can touch one fragment without the others.

    Schedule-aware momentum (`lr_scale`): an outer gradient is a sum of inner steps, so it carries the inner
    learning rate η it was trained at (Δ ≈ η·ĝ), and a plain buffer keeps old rates: when the inner rate
    decays, a buffer filled at the peak rate keeps taking peak-rate steps, and the annealing the
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

    def step_to(
        self,
        params: Mapping[str, Tensor],
        outer_grad: Mapping[str, Tensor],
        new_params: Mapping[str, Tensor],
        new_buf: Mapping[str, Tensor],
        lr_scale: float = 1.0,
        final: bool = False,
    ) -> OuterNesterov:
        """`step` out of place: the stepped parameters into `new_params` and the new momentum into `new_buf`
        (contiguous fp32, the shapes of `params`; lent memory the caller reuses), reading `params` and this
        optimizer without changing them; returns the optimizer that holds `new_buf`. The same operations as
        `step` on copies, bit for bit, in one pass instead of a copy and a pass.

        `final`: the last step of these parameters (nothing trains after it): they move by the outer gradient
        itself, ``p - g`` (the learners' weighted mean), without the outer rate and the momentum's look-ahead,
        which only pay off when training continues from the moved point (`ddiloco.syncer.drain`). The
        momentum is updated as usual."""
        if not (math.isfinite(lr_scale) and lr_scale >= 0):
            raise ValueError(f"outer step: lr_scale must be finite and >= 0, got {lr_scale}")
        if set(params) != set(outer_grad) or set(params) != set(new_params) or set(params) != set(new_buf):
            raise ValueError("outer step: parameters, outer_grad and the outputs name different tensors")
        m, lr, prev = self.momentum, self.lr, self.lr_scale
        decay = m * (lr_scale / prev) if prev is not None and prev > 0 else m
        out = OuterNesterov(lr=self.lr, momentum=self.momentum)
        out.lr_scale = float(lr_scale)
        for name, p in params.items():
            g = outer_grad[name].to(torch.float32).reshape(-1)
            np_, nb = new_params[name], new_buf[name]
            for t in (p, np_, nb):
                if (
                    t.dtype != torch.float32
                    or not t.is_contiguous()
                    or t.shape != p.shape
                    or g.numel() != p.numel()
                ):
                    raise ValueError(f"outer step: {name!r} needs contiguous float32 tensors of one shape")
            buf = self._buf.get(name)
            if buf is not None and buf.shape != p.shape:
                raise ValueError(
                    f"outer step: momentum for {name!r} has shape {list(buf.shape)}, parameter {list(p.shape)}"
                )
            pflat, npflat, nbflat = p.view(-1), np_.view(-1), nb.view(-1)
            bflat = None if buf is None else buf.reshape(-1)
            scratch = torch.empty(min(_CHUNK, pflat.numel()), dtype=torch.float32, device=p.device)
            for s in range(0, pflat.numel(), _CHUNK):
                gc, nbc = g[s : s + _CHUNK], nbflat[s : s + _CHUNK]
                if bflat is None:  # torch: momentum_buffer = clone(grad) on the first step, no update
                    nbc.copy_(gc)
                else:
                    torch.mul(bflat[s : s + _CHUNK], decay, out=nbc).add_(gc)
                if final:
                    torch.sub(pflat[s : s + _CHUNK], gc, out=npflat[s : s + _CHUNK])
                    continue
                d = torch.add(gc, nbc, alpha=m, out=scratch[: gc.numel()])  # g + m·buf
                torch.add(pflat[s : s + _CHUNK], d, alpha=-lr, out=npflat[s : s + _CHUNK])
            out._buf[name] = nb
        return out

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
