"""Block-wise symmetric integer codecs: int8, int4, int2 (`BlockwiseCodec`), for uploads and download deltas.

Symmetric absmax per block of `BLOCK` values of the flattened tensor: ``scale = absmax / L`` and
``code = round(x / scale)`` in ``-L..L`` (L = 127, 7, 1), so the round-trip error is at most half a step and
each block's largest value is exact; an all-zero block gets scale 0 and decodes to zeros. The last block is
zero-padded. Codes are stored offset-binary (``code + L``, so 0..2L: anything above 2L is corrupt) in uint8,
one, two or four per byte, next to one fp32 scale per block: ``{"q", "scale"}``. int4 and int2 pack
block-planar (`PACKING`: byte j of a block holds codes j, j + block/2 (int4; low nibble first) or j,
j + block/4, ... (int2; lowest bits first)), so unpacking is one mask and one shift per part on contiguous
rows (2x faster than interleaved pairs); payloads name `PACKING` and readers refuse any other.

Speed: on the CPU the work runs in chunks of `CPU_CHUNK` values with reused buffers (a first write to new
memory runs at ~1.7 GB/s on Linux against ~10 GB/s for a reused buffer, and chunks stay in L2); on an
accelerator the whole tensor is one chunk and only the packed result is copied to the CPU.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from ddiloco.codec.base import (
    BLOCK,
    CPU_CHUNK,
    FLT_MAX,
    MERGE_CHUNK,
    Checked,
    Codec,
    floating,
    norm64,
    part,
    scratch,
)

PACKING = "block-planar"
"""How int4/int2 codes sit in their bytes (module docstring); named in the header of every payload
(`ddiloco.protocol.validation.packing`). Interleaved pairs, written before, are refused."""
RANGE_STEP = 1 << 20
"""Packed bytes per chunk of `codes_in_range` (1 MiB: the chunk and its masked copy stay in cache)."""
_OUT_OF_RANGE = "{codec} codes out of range (> {top})"


def _check_byteorder() -> None:
    # _pack/_unpack read pairs/quads of codes as one little-endian integer word.
    if sys.byteorder != "little":
        raise RuntimeError("int codecs assume a little-endian host")


def _chunk_rows(n_blocks: int, block: int, device: torch.device) -> int:
    if device.type != "cpu":
        return max(n_blocks, 1)
    return max(1, CPU_CHUNK // block)


class BlockwiseCodec(Codec):
    """`bits` (8, 4 or 2) per code, L = 2**(bits−1) − 1 levels each side of zero, one fp32 scale per block."""

    scaled = True

    def __init__(self, name: str, bits: int, *, upload: bool = True, download: bool = True) -> None:
        if bits not in (2, 4, 8):
            raise ValueError(f"a blockwise codec packs 8, 4 or 2 bits per code, got {bits}")
        self.name, self.bits, self.upload, self.download = name, bits, upload, download
        self.levels = (1 << (bits - 1)) - 1
        self.per_byte = 8 // bits
        self.packing = PACKING if bits < 8 else None

    def check_block(self, block: int) -> None:
        super().check_block(block)
        if block % self.per_byte:
            raise ValueError(
                f"{self.name} packs {self.per_byte} codes per byte, so block must be a multiple of {self.per_byte}"
            )

    def part_specs(self, numel: int, block: int = BLOCK) -> dict[str, tuple[torch.dtype, int]]:
        n_blocks = -(-numel // block)
        return {"q": (torch.uint8, n_blocks * block * self.bits // 8), "scale": (torch.float32, n_blocks)}

    def encode(self, x: Tensor, *, block: int = BLOCK) -> dict[str, Tensor]:
        """``{"q": (n_blocks * block * bits / 8,) uint8, "scale": (n_blocks,) float32}``."""
        self.check_block(block)
        flat = floating(x)
        if flat.dtype != torch.float32:
            flat = flat.float()
        q, scale = _quantize(flat, self.bits, self.levels, block)
        if not bool(torch.isfinite(scale).all()):
            raise ValueError(
                f"cannot encode a tensor with NaN/Inf values ({self.name}); the learner has diverged"
            )
        return {"q": q.cpu().contiguous(), "scale": scale.cpu().contiguous()}

    def decode(
        self,
        parts: Mapping[str, Tensor],
        shape: Sequence[int],
        *,
        block: int = BLOCK,
        out: Tensor | None = None,
    ) -> Tensor:
        """Checks keys, dtypes, sizes, scales finite and >= 0 and codes in range while decoding."""
        numel, dims = self.decode_args(parts, shape, block, out)
        _check_byteorder()
        bits, L = self.bits, self.levels
        n_full, tail = divmod(numel, block)
        n_blocks = n_full + (tail > 0)
        q = part(parts, "q", torch.uint8, n_blocks * block * bits // 8, self.name)
        scale = part(parts, "scale", torch.float32, n_blocks, self.name)
        if n_blocks and not bool(torch.isfinite(scale).all()):
            raise ValueError(f"{self.name} scales hold NaN/Inf values")
        if n_blocks and bool((scale < 0).any()):
            raise ValueError(f"{self.name} scales must be >= 0 (absmax / {L}), found negative ones")
        if out is None:
            out = torch.empty(dims, dtype=torch.float32, device=q.device)
        flat = out.view(-1)  # (numel,)
        bytes_per_block = block * bits // 8
        rows = _chunk_rows(n_blocks, block, q.device)
        cbuf = torch.empty(min(rows, max(n_blocks, 1)) * block, dtype=torch.uint8, device=q.device)
        pieces = [
            (r, min(r + rows, n_full), flat[r * block : min(r + rows, n_full) * block])
            for r in range(0, n_full, rows)
        ]
        last = None
        if tail:  # the padded last block is decoded on the side, then its first `tail` values copied out
            last = torch.empty(block, dtype=torch.float32, device=q.device)
            pieces.append((n_full, n_blocks, last))
        for r0, r1, dst in pieces:
            y = dst.view(r1 - r0, block)
            codes = cbuf[: y.numel()]
            _unpack(q[r0 * bytes_per_block : r1 * bytes_per_block], codes, bits, block)
            if int(codes.max()) > 2 * L:
                raise ValueError(f"{self.name} codes out of range (> {2 * L}) in these {y.shape[0]} blocks")
            # Back to two's complement in uint8 arithmetic (mod 256), then one int8 -> fp32 cast and one multiply.
            signed = codes.sub_(L).view(torch.int8).view_as(y)
            y.copy_(signed).mul_(scale[r0:r1][:, None])
        if last is not None:
            flat[n_full * block :] = last[:tail]
        return out

    def check(
        self, parts: Mapping[str, Tensor], numel: int, *, measure: bool = False, buf: Tensor | None = None
    ) -> Checked:
        """Sizes, scales finite, >= 0 and small enough that no decoded value (nor the norm) overflows fp32,
        codes in range: without unpacking (`codes_in_range`), or, when `measure`, in the measuring pass
        over the unpacked codes."""
        L = self.levels
        q, scale = parts["q"].reshape(-1), parts["scale"].reshape(-1)
        n_blocks = -(-numel // BLOCK)
        if q.numel() != n_blocks * BLOCK * self.bits // 8 or scale.numel() != n_blocks:
            raise ValueError(f"{self.name} parts do not fit {numel} values")
        if n_blocks and not bool(torch.isfinite(scale).all()):
            raise ValueError(f"{self.name} scales hold NaN/Inf values")
        if n_blocks and bool((scale < 0).any()):
            raise ValueError(f"{self.name} scales must be >= 0 (absmax / {L}), found negative ones")
        # |value| <= L * scale, so ‖values‖ <= L·√BLOCK·‖scale‖
        bound = L * math.sqrt(BLOCK) * norm64(scale) if n_blocks else 0.0
        if bound > FLT_MAX:
            raise ValueError(f"{self.name} scales are too large (decoded values would overflow fp32)")
        flat_parts = {"q": q, "scale": scale}
        if measure:  # raises for codes out of range before any value is used
            n = self.accumulate(
                flat_parts, numel, None, 0.0, buf, overwrite=False, measure=True, check_range=True
            )
            return Checked(flat_parts, bound, n)
        if not codes_in_range(q, self):
            raise ValueError(_OUT_OF_RANGE.format(codec=self.name, top=2 * L))
        return Checked(flat_parts, bound, None)

    def accumulate(
        self,
        parts: Mapping[str, Tensor],
        numel: int,
        flat: Tensor | None,
        alpha: float,
        buf: Tensor | None,
        *,
        overwrite: bool,
        measure: bool,
        check_range: bool = False,
    ) -> float | None:
        """Per chunk of blocks: unpack the codes to integer-valued fp32 rows c (in cache); the norm is
        Σ_rows (‖c_row‖ · scale_row)² (exact integer sums of squares, fp64 over rows); the add is one fused
        ``acc_row += c_row · (scale_row · alpha)`` per row (``acc_row = ...`` when overwriting). The padded
        last block counts only its values. Without `measure` the add takes the int8 codes directly (the
        kernel widens them exactly, the same products bit for bit): no fp32 copy of the chunk, ~5% faster
        and 4 MiB less cache per merging thread. `check_range`: raise ValueError for a code above 2L, found
        on the unpacked chunk (a max over 1Mi bytes in cache instead of `codes_in_range`'s own pass).
        Views are made once per tensor, so a chunk costs ~8 torch calls (their dispatch is ~10% of a
        chunk's time)."""
        bits, L, per_byte = self.bits, self.levels, self.per_byte
        scale = parts["scale"]
        n_blocks, n_full, tail = scale.numel(), numel // BLOCK, numel % BLOCK
        if n_blocks == 0:
            return 0.0 if measure else None
        packed = parts["q"].view(n_blocks, BLOCK // per_byte)
        rows = min(MERGE_CHUNK // BLOCK, n_blocks)
        codes = torch.empty(rows, BLOCK, dtype=torch.uint8)
        unpacked = [codes.view(rows, per_byte, BLOCK // per_byte)[:, m, :] for m in range(per_byte)]
        signed = codes.view(torch.int8)  # offset-binary minus L in uint8 arithmetic: two's complement
        c = scratch(buf, rows * BLOCK).view(rows, BLOCK)
        row_norms = torch.empty(n_blocks, dtype=torch.float32) if measure else None  # ‖codes‖, then × scale
        if flat is not None:
            coef = torch.mul(scale, alpha)[:, None]
            acc_rows = flat[: n_full * BLOCK].view(n_full, BLOCK)
        for r0 in range(0, n_blocks, rows):
            k = min(rows, n_blocks - r0)
            whole = k == rows
            if bits == 8:
                if check_range and int(packed[r0 : r0 + k].max()) > 2 * L:
                    raise ValueError(_OUT_OF_RANGE.format(codec=self.name, top=2 * L))
                torch.sub(packed[r0 : r0 + k], L, out=codes if whole else codes[:k])
            else:
                unpack_parts(packed[r0 : r0 + k], unpacked if whole else [p[:k] for p in unpacked], bits)
                if check_range and int((codes if whole else codes[:k]).max()) > 2 * L:
                    raise ValueError(_OUT_OF_RANGE.format(codec=self.name, top=2 * L))
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
            return None
        return float(torch.linalg.vector_norm(row_norms.mul_(scale), dtype=torch.float64))

    def decode_range(
        self, parts: Mapping[str, Tensor], out: Tensor, start: int, alpha: float, buf: Tensor | None
    ) -> Tensor:
        """The blocks of the range only, added by `accumulate` (overwriting, not measured)."""
        n = out.numel()
        b0, b1 = start // BLOCK, -(-(start + n) // BLOCK)
        per_block = BLOCK * self.bits // 8
        sub = {"q": parts["q"][b0 * per_block : b1 * per_block], "scale": parts["scale"][b0:b1]}
        self.accumulate(sub, n, out, alpha, buf, overwrite=True, measure=False)
        return out


def _quantize(flat: Tensor, bits: int, L: int, block: int) -> tuple[Tensor, Tensor]:
    _check_byteorder()
    per_byte = 8 // bits
    numel = flat.numel()
    n_full, tail = divmod(numel, block)
    n_blocks = n_full + (tail > 0)
    bytes_per_block = block // per_byte
    q = torch.empty(n_blocks * bytes_per_block, dtype=torch.uint8, device=flat.device)
    scale = torch.empty(n_blocks, dtype=torch.float32, device=flat.device)
    rows = _chunk_rows(n_blocks, block, flat.device)
    fbuf = torch.empty(min(rows, n_blocks) * block, dtype=torch.float32, device=flat.device)
    cbuf = torch.empty(min(rows, n_blocks) * block, dtype=torch.uint8, device=flat.device)
    shifted = torch.empty_like(cbuf)
    pieces = [
        (r, min(r + rows, n_full), flat[r * block : min(r + rows, n_full) * block])
        for r in range(0, n_full, rows)
    ]
    if tail:  # zero-pad only the last block: a 1-block copy instead of a padded copy of the whole tensor
        last = torch.zeros(block, dtype=torch.float32, device=flat.device)
        last[:tail] = flat[n_full * block :]
        pieces.append((n_full, n_blocks, last))
    for r0, r1, src in pieces:
        xb = src.view(r1 - r0, block)  # (rows, block)
        s = scale[r0:r1]  # (rows,)
        # amax and amin separately: torch.aminmax(dim=1) is ~10x slower on the CPU.
        torch.maximum(xb.amax(dim=1), xb.amin(dim=1).neg_(), out=s).div_(L)
        safe = torch.where(s > 0, s, 1.0)[:, None]  # (rows, 1); zero blocks divide 0 by 1 -> code 0
        y = fbuf[: xb.numel()].view_as(xb)
        torch.div(xb, safe, out=y)
        # |x| <= absmax makes |y| <= L up to rounding; the clamp only guards subnormal scales.
        y.round_().clamp_(-L, L)
        codes = cbuf[: xb.numel()]
        # float -> int8 is a fast vectorised cast (float -> uint8 is not); adding L in uint8 arithmetic
        # (mod 256) then turns the two's-complement bytes into offset-binary codes 0..2L.
        codes.view(torch.int8).copy_(y.view(-1))
        codes.add_(L)
        _pack(codes, q[r0 * bytes_per_block : r1 * bytes_per_block], bits, shifted, block)
    return q, scale


def _pack(codes: Tensor, out: Tensor, bits: int, shifted: Tensor, block: int) -> None:
    """Pack ``codes`` (rows * block,) uint8 < 2**bits into ``out`` (rows * block * bits / 8,), block-planar:
    byte j of a block holds code j + m * block / per_byte at bit m * bits (m = 0 .. per_byte - 1).

    Each part of a byte comes from a contiguous run of a block's codes, so packing and unpacking are a
    whole-chunk shift and mask per part (int4: one of each) on rows of contiguous bytes. ``shifted``
    (>= the bytes of ``out``, uint8) holds a shifted part: a fresh temporary per chunk would cost page faults.
    """
    if bits == 8:
        out.copy_(codes)
        return
    per_byte = 8 // bits
    width = block // per_byte
    parts = codes.view(-1, per_byte, width)  # (rows, part, byte)
    packed = out.view(-1, width)
    shifted = shifted[: out.numel()].view(-1, width)
    packed.copy_(parts[:, 0, :])
    for m in range(1, per_byte):
        packed.bitwise_or_(torch.bitwise_left_shift(parts[:, m, :], bits * m, out=shifted))


def _unpack(q: Tensor, out: Tensor, bits: int, block: int) -> None:
    """Inverse of ``_pack``: ``q`` (rows * block * bits / 8,) uint8 into ``out`` (rows * block,) uint8."""
    if bits == 8:
        out.copy_(q)
        return
    per_byte = 8 // bits
    parts = out.view(-1, per_byte, block // per_byte)
    unpack_parts(q.view(-1, block // per_byte), [parts[:, m, :] for m in range(per_byte)], bits)


def unpack_parts(packed: Tensor, parts: Sequence[Tensor], bits: int) -> None:
    """``_unpack`` on views made once: ``packed`` (rows, bytes per block) into ``parts[m]`` (rows, bytes per
    block), the m-th code of every byte (int4: the low then the high nibble), as uint8 offset-binary codes."""
    mask = (1 << bits) - 1
    torch.bitwise_and(packed, mask, out=parts[0])
    for m in range(1, len(parts)):
        p = torch.bitwise_right_shift(packed, bits * m, out=parts[m])
        if m < len(parts) - 1:  # the top part has no higher bits to mask off
            p.bitwise_and_(mask)


def codes_in_range(q: Tensor, codec: BlockwiseCodec | str) -> bool:
    """Whether every code packed in ``q`` (uint8) is at most 2L, without unpacking (`codec`: one of this
    family, or its name). A code is out of range iff all its bits are set (2**bits − 1, the only value above
    2L), so per chunk of bytes: the top code of a byte is iff the byte is ≥ that pattern shifted to the top;
    each lower code iff the byte masked to its bits reaches the mask. Byte-wide max reductions (32 bytes
    per AVX2 instruction): 3.6× faster at int4 than ANDing shifted 64-bit words (24 MB: 3.0 against 10.6 ms)."""
    c = codec if isinstance(codec, BlockwiseCodec) else BY_NAME[codec]
    bits, L = c.bits, c.levels
    if q.numel() == 0:
        return True
    if bits == 8:
        return int(q.max()) <= 2 * L
    code = (1 << bits) - 1
    top = code << (8 - bits)
    masks = [code << (bits * m) for m in range(8 // bits - 1)]
    flat = q.reshape(-1)
    buf = torch.empty(min(RANGE_STEP, flat.numel()), dtype=torch.uint8, device=q.device)
    for i in range(0, flat.numel(), RANGE_STEP):
        chunk = flat[i : i + RANGE_STEP]
        if int(chunk.max()) >= top:
            return False
        for m in masks:
            if int(torch.bitwise_and(chunk, m, out=buf[: chunk.numel()]).max()) == m:
                return False
    return True


INT8 = BlockwiseCodec("int8", 8)
INT4 = BlockwiseCodec("int4", 4)
INT2 = BlockwiseCodec("int2", 2)
FAMILY = (INT8, INT4, INT2)
"""This family's codecs, in the order the registry lists them."""
BY_NAME = {c.name: c for c in FAMILY}
