"""An uploaded tensor kept encoded until it is merged: checked whole first, then decoded chunk by chunk
straight into the syncer's running sums.

Decoding an answer into a fresh fp32 copy of its fragment and then adding that copy costs a first touch of
new memory (page faults, ~2 GB/s) and three more passes over DRAM. `EncodedTensor.accumulate` decodes a
chunk of ~512Ki values into a small buffer that stays in cache, measures its norm there and adds it to the
sum, so the only DRAM traffic is the packed codes and one read-modify-write of the sum: about the bytes a
plain copy moves.

Design choices:
- Everything that could make an answer unacceptable is checked in `EncodedTensor.check`, before any value is
  added (keys, dtypes, sizes, codes in range without unpacking, scales finite and small enough that no
  decoded value overflows, fp32/bf16 data finite): a bad answer never leaves part of itself in a sum.
- The norm. RDA adds Δ/‖Δ‖, so the norm is needed before the add. A pass that only measures it costs as
  much as decoding (12 GB/s here against 10 GB/s for decode-and-add), so learners send it in the header
  (`norms`, per tensor, computed by `norm` on what they encoded) and `accumulate` measures the real norm in
  the same pass. A claim off by more than `HINT_RTOL` (a bug or a lie) costs a second pass that adds the
  difference of coefficients, so the sum is what the true norm gives; without a claim the syncer measures
  first. fp32/bf16 data are read once by `check` anyway, which measures the norm there.
- Norms are fp64 sums of fp32 norms of 128-value rows (as fast as one fp32 dot product per chunk, which is
  off by ~3e-6 per 512Ki values; one fp32 reduction over a whole 48M-value tensor is off by 0.6%). Chunks
  follow the codec's blocks and `norm` and `accumulate` chunk alike, so a learner's claim and the syncer's
  measurement are the same sum.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ddiloco.compression import _CHUNK_ELEMS, _INT, BLOCK, codes_in_range, decode, decode_rows

HINT_RTOL = 1e-6
"""How far a claimed norm may differ from the measured one before the sum is corrected (fp32 rounding of
the same computation on other hardware stays far below)."""
_FLT_MAX = 3.4028234663852886e38


@dataclass(frozen=True, slots=True)
class EncodedTensor:
    """One tensor of an answer as uploaded: ``codec`` and its flat ``parts`` (`ddiloco.compression`)."""

    codec: str
    shape: torch.Size
    parts: Mapping[str, Tensor]
    known_norm: float | None = None
    """‖values‖ when `check` measured it (fp32/bf16); None for the int codecs."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @classmethod
    def check(cls, parts: Mapping[str, Tensor], codec: str, shape: Sequence[int]) -> EncodedTensor:
        """Validate untrusted parts whole (module docstring); ``ValueError`` naming the problem."""
        shape = torch.Size(shape)
        numel = math.prod(shape)
        if codec in ("fp32", "bf16"):
            data = parts["data"].reshape(-1)
            if data.numel() != numel:
                raise ValueError(f"{codec} data has {data.numel()} values, expected {numel}")
            n = cls(codec, shape, {"data": data}).norm()
            if not math.isfinite(n) or n > _FLT_MAX:
                raise ValueError(f"{codec} data holds NaN/Inf values (or values whose square overflows fp32)")
            return cls(codec, shape, {"data": data}, n)
        bits, L = _INT[codec]
        q, scale = parts["q"].reshape(-1), parts["scale"].reshape(-1)
        n_blocks = -(-numel // BLOCK)
        if q.numel() != n_blocks * BLOCK * bits // 8 or scale.numel() != n_blocks:
            raise ValueError(f"{codec} parts do not fit {numel} values")
        if n_blocks and not bool(torch.isfinite(scale).all()):
            raise ValueError(f"{codec} scales hold NaN/Inf values")
        if n_blocks and bool((scale < 0).any()):
            raise ValueError(f"{codec} scales must be >= 0 (absmax / {L}), found negative ones")
        # No decoded value, nor the norm, may overflow fp32: |value| <= L * scale, ‖values‖ <= that bound.
        bound = L * math.sqrt(BLOCK) * norm64(scale) if n_blocks else 0.0
        if bound > _FLT_MAX:
            raise ValueError(f"{codec} scales are too large (decoded values would overflow fp32)")
        if not codes_in_range(q, codec):
            raise ValueError(f"{codec} codes out of range (> {2 * L})")
        return cls(codec, shape, {"q": q, "scale": scale})

    def chunks(self, buf: Tensor | None = None) -> Iterator[tuple[int, Tensor]]:
        """(offset, fp32 values) of consecutive chunks; the values are views into ``buf`` (fp32, at least
        one chunk long; reused between chunks) or of the data itself (fp32)."""
        numel = self.numel
        if self.codec in ("fp32", "bf16"):
            data = self.parts["data"]
            for i in range(0, numel, _CHUNK_ELEMS):
                c = data[i : i + _CHUNK_ELEMS]
                if self.codec == "fp32":
                    yield i, c
                else:
                    yield i, _buf(buf, c.numel()).copy_(c)
            return
        bits, _ = _INT[self.codec]
        per_block = BLOCK * bits // 8
        rows = _CHUNK_ELEMS // BLOCK
        q, scale = self.parts["q"], self.parts["scale"]
        cbuf = torch.empty(min(rows, scale.numel()) * BLOCK, dtype=torch.uint8)
        scratch = torch.empty_like(cbuf)
        for r0 in range(0, scale.numel(), rows):
            r1 = min(r0 + rows, scale.numel())
            y = _buf(buf, (r1 - r0) * BLOCK).view(r1 - r0, BLOCK)
            decode_rows(
                q[r0 * per_block : r1 * per_block], scale[r0:r1], y, self.codec, cbuf, scratch, check=False
            )
            start = r0 * BLOCK
            yield start, y.view(-1)[: min(numel - start, y.numel())]  # the padded tail is dropped

    def norm(self, buf: Tensor | None = None) -> float:
        """‖decoded values‖ (fp64 sum of per-chunk fp32 dot products; what learners claim in `norms`)."""
        if self.known_norm is not None:
            return self.known_norm
        return math.sqrt(sum(_sumsq(c) for _, c in self.chunks(buf)))

    def accumulate(self, acc: Tensor, alpha: float, buf: Tensor | None = None) -> float:
        """``acc += alpha * values`` (acc: fp32 of this shape, contiguous) in one pass; returns ‖values‖."""
        flat = acc.view(-1)
        total = 0.0
        for i, c in self.chunks(buf):
            total += _sumsq(c)
            if alpha != 0.0:
                flat[i : i + c.numel()].add_(c, alpha=alpha)
        return self.known_norm if self.known_norm is not None else math.sqrt(total)

    def decode(self) -> Tensor:
        """The values as a fresh fp32 tensor of `shape` (rare paths: clipping, single answers)."""
        return decode(dict(self.parts), self.codec, self.shape)


def chunk_buffer() -> Tensor:
    """A decode buffer for `chunks` / `accumulate` (one per thread)."""
    return torch.empty(_CHUNK_ELEMS, dtype=torch.float32)


def _buf(buf: Tensor | None, n: int) -> Tensor:
    if buf is None or buf.numel() < n:
        return torch.empty(n, dtype=torch.float32)
    return buf[:n]


def _sumsq(c: Tensor) -> float:
    """Σ c² of an fp32 chunk: fp32 norms of 128-value rows, squared and summed in fp64."""
    k = c.numel() - c.numel() % BLOCK
    total = 0.0
    if k:
        total += float(torch.linalg.vector_norm(c[:k].view(-1, BLOCK), dim=1).double().square().sum())
    if k < c.numel():
        total += float(c[k:].double().square().sum())
    return total


def norm64(t: Tensor) -> float:
    """‖t‖ of an fp32 tensor as `EncodedTensor.norm` measures it (chunked, fp64 sum)."""
    flat = t.reshape(-1)
    return math.sqrt(sum(_sumsq(flat[i : i + _CHUNK_ELEMS]) for i in range(0, flat.numel(), _CHUNK_ELEMS)))
