"""An uploaded tensor kept encoded until it is merged: checked whole first, then decoded chunk by chunk
straight into the syncer's running sums by its codec (`ddiloco.codec.base.Codec`).

Decoding an answer into a fresh fp32 copy and then adding that copy costs a first touch of new memory (page
faults, ~2 GB/s) and three more passes over DRAM; decoding a chunk into a buffer that stays in cache and
adding it there moves about the bytes of a plain copy. Everything that could make an answer unacceptable is
checked in `EncodedTensor.check`, before any value is added: a bad answer never leaves part of itself in a
sum. RDA adds Δ/‖Δ‖, so the norm is needed before the add; a pass that only measures it costs as much as
decoding, so learners send it in the header (`norms`, computed by `norm` on what they encoded) and
`accumulate` measures the real norm in the same pass. A claim off by more than `HINT_RTOL` (a bug or a lie)
costs a second pass that adds the difference of coefficients, so the sum is what the true norm gives.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ddiloco.codec.base import BLOCK, Codec
from ddiloco.codec.registry import decode, get

HINT_RTOL = 1e-6
"""How far a claimed norm may differ from the measured one before the sum is corrected (fp32 rounding of
the same computation on other hardware stays far below)."""


@dataclass(frozen=True, slots=True)
class EncodedTensor:
    """One tensor of an answer as uploaded: the name of its ``codec`` (`ddiloco.codec.registry`) and its
    flat ``parts``."""

    codec: str
    shape: torch.Size
    parts: Mapping[str, Tensor]
    bound: float = math.inf
    """An upper bound on ‖values‖ from the parts alone (blockwise codecs: L·√BLOCK·‖scale‖)."""
    known_norm: float | None = None
    """‖values‖ when this syncer measured it already (`measured`, or `check` with `measure` for the
    blockwise codecs: the intake's readers do, so the merge's pass only adds)."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def _codec(self) -> Codec:
        return get(self.codec)

    @classmethod
    def check(
        cls,
        parts: Mapping[str, Tensor],
        codec: str,
        shape: Sequence[int],
        *,
        measure: bool = False,
        buf: Tensor | None = None,
    ) -> EncodedTensor:
        """Validate untrusted parts whole (`Codec.check`); ``ValueError`` naming the problem. `measure`:
        return it with its norm measured where the check can do so in its own pass (`buf`: `chunk_buffer`)."""
        shape = torch.Size(shape)
        checked = get(codec).check(parts, math.prod(shape), measure=measure, buf=buf)
        return cls(codec, shape, checked.parts, checked.bound, checked.norm)

    def plausible(self, claim: float) -> bool:
        """Whether a claimed norm could be this tensor's. Absmax encoding decodes each block's largest value
        to exactly L·scale, so an honest norm lies in [L·‖scale‖, L·√BLOCK·‖scale‖]; a claim in that range
        adds at most √BLOCK times the answer's due share before the correction, so a wrong one costs a
        second pass but never the sum's precision (a claim of 1e-30 would add 1e30 × the values)."""
        if self.bound == math.inf:
            return True
        return self.bound / math.sqrt(BLOCK) * (1 - HINT_RTOL) <= claim <= self.bound * (1 + HINT_RTOL)

    def measured(self, buf: Tensor | None = None) -> EncodedTensor:
        """This tensor with its norm measured (`known_norm`)."""
        return self if self.known_norm is not None else dataclasses.replace(self, known_norm=self.norm(buf))

    def norm(self, buf: Tensor | None = None) -> float:
        """‖decoded values‖, computed exactly as `accumulate` measures it (what learners claim in `norms`)."""
        return self.accumulate(None, 0.0, buf)

    def accumulate(
        self, acc: Tensor | None, alpha: float, buf: Tensor | None = None, *, overwrite: bool = False
    ) -> float:
        """``acc += alpha * values`` (acc: contiguous fp32 of this shape; None: only measure) in one pass
        over the encoded data; returns ‖values‖. `overwrite`: ``acc = alpha * values`` instead (what acc
        held is never read, so a sum's first answer needs no zeroed buffer and no read of it)."""
        if self.known_norm is not None and (acc is None or (alpha == 0.0 and not overwrite)):
            return self.known_norm
        flat = acc.view(-1) if acc is not None and (alpha != 0.0 or overwrite) else None
        measure = self.known_norm is None
        n = self._codec.accumulate(
            self.parts, self.numel, flat, alpha, buf, overwrite=overwrite, measure=measure
        )
        return n if measure else self.known_norm  # type: ignore[return-value]

    def decode_range(self, out: Tensor, start: int, alpha: float = 1.0, buf: Tensor | None = None) -> Tensor:
        """``alpha × values[start : start + out.numel()]`` into `out` (flat contiguous fp32), in one pass over
        that part of the encoded data; `start` a multiple of BLOCK (a robust merge reads its answers chunk by
        chunk: `ddiloco.syncer.merge.robust`)."""
        n = out.numel()
        if start % BLOCK or start + n > self.numel:
            raise ValueError(
                f"decode_range: [{start}, {start + n}) is not a block-aligned part of {self.numel}"
            )
        return self._codec.decode_range(self.parts, out, start, alpha, buf)

    def decode(self) -> Tensor:
        """The values as a fresh fp32 tensor of `shape` (rare paths: clipping, single answers)."""
        return decode(dict(self.parts), self.codec, self.shape)
