"""An uploaded tensor kept encoded until it is merged: checked whole first, then decoded chunk by chunk
straight into the syncer's running sums.

Decoding an answer into a fresh fp32 copy of its fragment and then adding that copy costs a first touch of
new memory (page faults, ~2 GB/s) and three more passes over DRAM. `EncodedTensor.accumulate` unpacks a
chunk of 1Mi codes into a small buffer that stays in cache, measures the norm there and adds the chunk to
the sum with one fused multiply-add per row (``acc += codes · scale · alpha``), so the only DRAM traffic is
the packed codes and one read-modify-write of the sum: about the bytes a plain copy moves.

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
- Norms are fp64 sums over 128-value rows of fp32 row norms (for int codecs, of the integer codes times the
  row's scale): as fast as one fp32 dot product per chunk, which is off by ~3e-6 per 512Ki values, while
  one fp32 reduction over a whole 48M-value tensor is off by 0.6%. `norm` is `accumulate` without the add,
  so a learner's claim and the syncer's measurement are the same computation.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ddiloco.compression import _INT, BLOCK, codes_in_range, decode, unpack_parts

MERGE_CHUNK = 1 << 20
"""Values per chunk (4 MiB of fp32): the per-chunk work stays in cache and the ~8 torch calls of a chunk
cost little next to it (512Ki-2Mi measured best at the 1b preset's fragments, 1Mi best on 1 and 2 threads)."""
HINT_RTOL = 1e-6
"""How far a claimed norm may differ from the measured one before the sum is corrected (fp32 rounding of
the same computation on other hardware stays far below)."""
_FLT_MAX = 3.4028234663852886e38
_OUT_OF_RANGE = "{codec} codes out of range (> {top})"


@dataclass(frozen=True, slots=True)
class EncodedTensor:
    """One tensor of an answer as uploaded: ``codec`` and its flat ``parts`` (`ddiloco.compression`)."""

    codec: str
    shape: torch.Size
    parts: Mapping[str, Tensor]
    bound: float = math.inf
    """An upper bound on ‖values‖ from the scales alone (int codecs: L·√BLOCK·‖scale‖)."""
    known_norm: float | None = None
    """‖values‖ when this syncer measured it already: `check` for fp32/bf16, `measured` for the int codecs
    (the intake's readers do, so the merge's pass only adds)."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

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
        """Validate untrusted parts whole (module docstring); ``ValueError`` naming the problem. `measure`:
        return it with its norm measured (`measured`); for the int codecs the codes' range is then checked in
        that same pass over the unpacked codes instead of in a pass of its own (`buf`: `chunk_buffer`)."""
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
        checked = cls(codec, shape, {"q": q, "scale": scale}, bound=bound)
        if measure:  # raises for codes out of range before any value is used
            return dataclasses.replace(
                checked, known_norm=checked._accumulate_int(None, 0.0, buf, False, check_range=True)
            )
        if not codes_in_range(q, codec):
            raise ValueError(_OUT_OF_RANGE.format(codec=codec, top=2 * L))
        return checked

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
        if self.codec in ("fp32", "bf16"):
            total = 0.0
            data = self.parts["data"]
            for i in range(0, self.numel, MERGE_CHUNK):
                c = data[i : i + MERGE_CHUNK]
                if self.codec == "bf16":
                    c = _buf(buf, c.numel()).copy_(c)
                if self.known_norm is None:
                    total += _sumsq(c)
                if flat is None:
                    continue
                if overwrite:
                    torch.mul(c, alpha, out=flat[i : i + c.numel()])
                else:
                    flat[i : i + c.numel()].add_(c, alpha=alpha)
            return self.known_norm if self.known_norm is not None else math.sqrt(total)
        return self._accumulate_int(flat, alpha, buf, overwrite)

    def _accumulate_int(
        self,
        flat: Tensor | None,
        alpha: float,
        buf: Tensor | None,
        overwrite: bool,
        check_range: bool = False,
    ) -> float:
        """Per chunk of blocks: unpack the codes to integer-valued fp32 rows c (in cache); the norm is
        Σ_rows (‖c_row‖ · scale_row)² (exact integer sums of squares, fp64 over rows); the add is one fused
        ``acc_row += c_row · (scale_row · alpha)`` per row (``acc_row = ...`` when overwriting). The padded
        last block counts only its values. When the norm is known already (a reader measured it), the add
        takes the int8 codes directly (the kernel widens them exactly, the same products bit for bit): no
        fp32 copy of the chunk, ~5% faster and 4 MiB less cache per merging thread. `check_range`: raise
        ValueError for a code above 2L, found on the unpacked chunk (`check(measure=True)`; a max over 1Mi
        bytes in cache instead of `codes_in_range`'s own pass over the packed codes).
        Views are made once per tensor, so a chunk costs ~8 torch calls (their dispatch is ~10% of a
        chunk's time)."""
        bits, L = _INT[self.codec]
        per_byte = 8 // bits
        numel, scale = self.numel, self.parts["scale"]
        n_blocks, n_full, tail = scale.numel(), numel // BLOCK, numel % BLOCK
        if n_blocks == 0:
            return self.known_norm or 0.0
        packed = self.parts["q"].view(n_blocks, BLOCK // per_byte)
        rows = min(MERGE_CHUNK // BLOCK, n_blocks)
        codes = torch.empty(rows, BLOCK, dtype=torch.uint8)
        parts = [codes.view(rows, per_byte, BLOCK // per_byte)[:, m, :] for m in range(per_byte)]
        signed = codes.view(torch.int8)  # offset-binary minus L in uint8 arithmetic: two's complement
        c = _buf(buf, rows * BLOCK).view(rows, BLOCK)
        measure = self.known_norm is None
        row_norms = torch.empty(n_blocks, dtype=torch.float32) if measure else None  # ‖codes‖, then × scale
        if flat is not None:
            coef = torch.mul(scale, alpha)[:, None]
            acc_rows = flat[: n_full * BLOCK].view(n_full, BLOCK)
        for r0 in range(0, n_blocks, rows):
            k = min(rows, n_blocks - r0)
            whole = k == rows
            if bits == 8:
                if check_range and int(packed[r0 : r0 + k].max()) > 2 * L:
                    raise ValueError(_OUT_OF_RANGE.format(codec=self.codec, top=2 * L))
                torch.sub(packed[r0 : r0 + k], L, out=codes if whole else codes[:k])
            else:
                unpack_parts(packed[r0 : r0 + k], parts if whole else [p[:k] for p in parts], bits)
                if check_range and int((codes if whole else codes[:k]).max()) > 2 * L:
                    raise ValueError(_OUT_OF_RANGE.format(codec=self.codec, top=2 * L))
                (codes if whole else codes[:k]).sub_(L)
            full = min(k, n_full - r0)  # rows wholly inside the tensor
            if measure:  # the norm needs fp32 codes in cache; the add alone takes the int8 codes as they are
                ck = c if whole else c[:k]
                ck.copy_(signed if whole else signed[:k])
                torch.linalg.vector_norm(ck, dim=1, out=row_norms[r0 : r0 + k])
                if full < k:  # the padded last block: only its first `tail` values
                    row_norms[n_full] = torch.linalg.vector_norm(ck[full, :tail])
            else:
                ck = signed if whole else signed[:k]
            if flat is None:
                continue
            if full > 0:
                rows_c, rows_coef = (ck if full == k else ck[:full]), coef[r0 : r0 + full]
                if overwrite:
                    torch.mul(rows_c, rows_coef, out=acc_rows[r0 : r0 + full])
                else:
                    acc_rows[r0 : r0 + full].addcmul_(rows_c, rows_coef)
            if full < k:  # the padded last block: only its first `tail` values
                last, tail_acc = ck[full, :tail], flat[n_full * BLOCK :]
                if overwrite:
                    torch.mul(last, coef[n_full], out=tail_acc)
                else:
                    tail_acc.addcmul_(last, coef[n_full])
        if not measure:
            return self.known_norm  # type: ignore[return-value]
        return float(torch.linalg.vector_norm(row_norms.mul_(scale), dtype=torch.float64))

    def decode_range(self, out: Tensor, start: int, alpha: float = 1.0, buf: Tensor | None = None) -> Tensor:
        """``alpha × values[start : start + out.numel()]`` into `out` (flat contiguous fp32), in one pass over
        that part of the encoded data; `start` a multiple of BLOCK (a robust merge reads its answers chunk by
        chunk: `ddiloco.robust`)."""
        n = out.numel()
        if start % BLOCK or start + n > self.numel:
            raise ValueError(
                f"decode_range: [{start}, {start + n}) is not a block-aligned part of {self.numel}"
            )
        if self.codec in ("fp32", "bf16"):
            out.copy_(self.parts["data"][start : start + n])
            return out.mul_(alpha) if alpha != 1.0 else out
        bits = _INT[self.codec][0]
        b0, b1 = start // BLOCK, -(-(start + n) // BLOCK)
        per_block = BLOCK * bits // 8
        part = EncodedTensor(
            self.codec,
            torch.Size([n]),
            {"q": self.parts["q"][b0 * per_block : b1 * per_block], "scale": self.parts["scale"][b0:b1]},
            known_norm=0.0,  # not measured: only the add is wanted (the codes are taken as they are)
        )
        part._accumulate_int(out, alpha, buf, overwrite=True)
        return out

    def decode(self) -> Tensor:
        """The values as a fresh fp32 tensor of `shape` (rare paths: clipping, single answers)."""
        return decode(dict(self.parts), self.codec, self.shape)


def chunk_buffer() -> Tensor:
    """A decode buffer for `accumulate` (one per thread)."""
    return torch.empty(MERGE_CHUNK, dtype=torch.float32)


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
    return math.sqrt(sum(_sumsq(flat[i : i + MERGE_CHUNK]) for i in range(0, flat.numel(), MERGE_CHUNK)))
