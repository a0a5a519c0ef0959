"""Upload codecs for learner deltas: fp32, bf16 and block-wise symmetric int8 / int4 / int2.

Learners upload ``delta = theta - anchor`` per fragment; the syncer dequantizes and accumulates in fp32.
Design choices:

- Symmetric absmax per block of ``block`` (128) values of the flattened tensor: ``scale = absmax / L`` and
  ``code = round(x / scale)`` in ``-L..L`` (L = 127, 7, 1), so the round-trip error is at most half a step
  (``scale / 2``) and the largest value of each block is exact. An all-zero block gets scale 0 and decodes
  to exact zeros. The last block is zero-padded; padding costs at most ``block - 1`` codes per tensor.
- Codes are stored offset-binary (``code + L``, so 0..2L) in ``uint8``: one per byte for int8, two per byte
  for int4, four per byte for int2. Offset-binary makes the validity check one ``max`` over the codes:
  anything above 2L is corrupt. int4 and int2 are packed block-planar (`PACKING`): byte j of a block holds
  codes j, j + block/2 (int4; low nibble first) or j, j + block/4, ... (int2; lowest bits first), so
  unpacking a chunk is one mask and one shift per part on contiguous rows (the syncer unpacks every
  answer: 2x faster than interleaved pairs). Payloads carrying int4/int2 codes name `PACKING` in their
  header and readers refuse any other, so learners and syncers of different packings never mix silently.
- Parts are plain contiguous CPU tensors (``{"data"}`` or ``{"q", "scale"}``) so the wire layer can put them
  in safetensors next to each other; this module does no I/O.
- Speed. On the CPU the work runs in chunks of a few thousand blocks with reused buffers: large fresh
  allocations are paid in page faults (a first write to new memory runs at ~1.7 GB/s on Linux against
  ~10 GB/s for a reused buffer), and chunks stay in L2. ``decode(..., out=buf)`` lets the syncer reuse its
  own fp32 buffers across rounds for the same reason. On an accelerator the whole tensor is one chunk and
  only the packed result is copied to the CPU (1/8 of the bytes for int4).
- Untrusted input. ``decode`` reads what any learner (or anything else with store access) wrote, so it checks
  keys, dtypes, sizes against ``shape`` and ``block``, scales finite and >= 0, codes in range, fp32/bf16
  data finite, and raises ``ValueError`` naming the problem. ``encode`` refuses non-finite input: a NaN
  delta means the learner diverged, and uploading it would only get it rejected later.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

__all__ = [
    "BLOCK",
    "all_finite",
    "CODECS",
    "PACKING",
    "codes_in_range",
    "decode",
    "decode_rows",
    "encode",
    "encoded_nbytes",
    "unpack_parts",
]

CODECS = ("fp32", "bf16", "int8", "int4", "int2")
BLOCK = 128

# codec -> (bits per code, largest level L); codes are -L..L, stored as code + L.
_INT = {"int8": (8, 127), "int4": (4, 7), "int2": (2, 1)}
PACKING = "block-planar"
"""How int4/int2 codes sit in their bytes (module docstring); named in the header of every payload that
carries them (`ddiloco.protocol.validation.packing`). Interleaved pairs, written before, are refused."""
_CHUNK_ELEMS = 1 << 19  # 512Ki values (2 MiB fp32) per chunk on the CPU: temporaries stay in cache, and
# per-op dispatch (~3-5 us, some 12 ops a chunk) stays small next to the work (measured best of 64Ki..2Mi)


def _check_codec(codec: str) -> None:
    if codec not in CODECS:
        raise ValueError(f"unknown codec {codec!r}; expected one of {', '.join(CODECS)}")


def _check_block(codec: str, block: int) -> None:
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"block must be a positive integer, got {block!r}")
    if codec in _INT:
        per_byte = 8 // _INT[codec][0]
        if block % per_byte:
            raise ValueError(
                f"{codec} packs {per_byte} codes per byte, so block must be a multiple of {per_byte}"
            )


def encoded_nbytes(numel: int, codec: str, *, block: int = BLOCK) -> int:
    """Payload bytes of one encoded tensor of ``numel`` values (codes + scales), for bandwidth accounting."""
    _check_codec(codec)
    _check_block(codec, block)
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    if codec == "fp32":
        return 4 * numel
    if codec == "bf16":
        return 2 * numel
    bits, _ = _INT[codec]
    n_blocks = -(-numel // block)
    return n_blocks * block * bits // 8 + 4 * n_blocks


def all_finite(x: Tensor) -> bool:
    """Whether `x` holds no NaN/Inf, exactly. One streaming sum decides almost always (NaN and Inf
    propagate through it); ``isfinite(x).all()`` would allocate a bool tensor as large as x (48 MB and
    ~0.2 s of page faults for a 1b fragment), and ``sum(dtype=...)`` a converted copy. Only a sum past
    the dtype's range (or a NaN/Inf) takes the exact chunked check."""
    if x.numel() == 0 or bool(torch.isfinite(x.sum())):
        return True
    flat = x.reshape(-1)
    return all(
        bool(torch.isfinite(flat[i : i + _CHUNK_ELEMS]).all()) for i in range(0, flat.numel(), _CHUNK_ELEMS)
    )


def _chunk_rows(n_blocks: int, block: int, device: torch.device) -> int:
    if device.type != "cpu":
        return max(n_blocks, 1)
    return max(1, _CHUNK_ELEMS // block)


def encode(x: Tensor, codec: str, *, block: int = BLOCK) -> dict[str, Tensor]:
    """Encode ``x`` (any shape, floating) for upload; returns contiguous CPU tensors.

    fp32/bf16: ``{"data": (numel,)}``; for fp32 on the CPU ``data`` may share memory with ``x`` (clone ``x``
    first if it will change before the bytes are written). intN: ``{"q": (n_blocks * block * bits / 8,)
    uint8, "scale": (n_blocks,) float32}``.
    """
    _check_codec(codec)
    _check_block(codec, block)
    if not isinstance(x, Tensor) or not x.is_floating_point():
        raise ValueError(f"encode expects a floating-point tensor, got {getattr(x, 'dtype', type(x))}")
    flat = x.detach().reshape(-1)  # (numel,)
    if codec in ("fp32", "bf16"):
        data = flat.to(torch.float32 if codec == "fp32" else torch.bfloat16)
        if not all_finite(data):
            raise ValueError(
                f"cannot encode a tensor with NaN/Inf values ({codec}); the learner has diverged"
            )
        return {"data": data.cpu().contiguous()}
    if flat.dtype != torch.float32:
        flat = flat.float()
    q, scale = _quantize(flat, codec, block)
    if not bool(torch.isfinite(scale).all()):
        raise ValueError(f"cannot encode a tensor with NaN/Inf values ({codec}); the learner has diverged")
    return {"q": q.cpu().contiguous(), "scale": scale.cpu().contiguous()}


def _check_byteorder() -> None:
    # _pack/_unpack read pairs/quads of codes as one little-endian integer word.
    if sys.byteorder != "little":
        raise RuntimeError("int codecs assume a little-endian host")


def _quantize(flat: Tensor, codec: str, block: int) -> tuple[Tensor, Tensor]:
    _check_byteorder()
    bits, L = _INT[codec]
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
    scratch = torch.empty_like(cbuf)
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
        _pack(codes, q[r0 * bytes_per_block : r1 * bytes_per_block], bits, scratch, block)
    return q, scale


def _pack(codes: Tensor, out: Tensor, bits: int, scratch: Tensor, block: int = BLOCK) -> None:
    """Pack ``codes`` (rows * block,) uint8 < 2**bits into ``out`` (rows * block * bits / 8,), block-planar:
    byte j of a block holds code j + m * block / per_byte at bit m * bits (m = 0 .. per_byte - 1).

    Each part of a byte comes from a contiguous run of a block's codes, so packing and unpacking are a
    whole-chunk shift and mask per part (int4: one of each) on rows of contiguous bytes, with no
    interleaving and no word tricks. ``scratch`` (>= the bytes of ``out``, uint8) holds a shifted part: a
    fresh temporary per chunk would cost page faults.
    """
    if bits == 8:
        out.copy_(codes)
        return
    per_byte = 8 // bits
    width = block // per_byte
    parts = codes.view(-1, per_byte, width)  # (rows, part, byte)
    packed = out.view(-1, width)
    shifted = scratch[: out.numel()].view(-1, width)
    packed.copy_(parts[:, 0, :])
    for m in range(1, per_byte):
        packed.bitwise_or_(torch.bitwise_left_shift(parts[:, m, :], bits * m, out=shifted))


def _unpack(q: Tensor, out: Tensor, bits: int, block: int = BLOCK) -> None:
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
        part = torch.bitwise_right_shift(packed, bits * m, out=parts[m])
        if m < len(parts) - 1:  # the top part has no higher bits to mask off
            part.bitwise_and_(mask)


def _shape_numel(shape: Sequence[int]) -> int:
    try:
        dims = tuple(shape)
    except TypeError:
        raise ValueError(f"shape must be a sequence of integers, got {shape!r}") from None
    for d in dims:
        if isinstance(d, bool) or not isinstance(d, int) or d < 0:
            raise ValueError(f"shape must hold non-negative integers, got {list(dims)!r}")
    return math.prod(dims)


def _part(parts: Mapping[str, Tensor], key: str, dtype: torch.dtype, length: int, codec: str) -> Tensor:
    t = parts[key]
    if not isinstance(t, Tensor):
        raise ValueError(f"{codec} part {key!r} is a {type(t).__name__}, expected a tensor")
    if t.dtype != dtype:
        raise ValueError(f"{codec} part {key!r} has dtype {t.dtype}, expected {dtype}")
    if t.dim() != 1 or t.numel() != length:
        raise ValueError(f"{codec} part {key!r} has shape {list(t.shape)}, expected [{length}]")
    return t.contiguous()


def decode(
    parts: Mapping[str, Tensor],
    codec: str,
    shape: Sequence[int],
    *,
    block: int = BLOCK,
    out: Tensor | None = None,
) -> Tensor:
    """Decode untrusted ``parts`` into an fp32 tensor of ``shape``; ``ValueError`` on anything malformed.

    ``out`` (fp32, contiguous, of ``shape``) receives the result when given, so a caller decoding the same
    fragment every round can reuse its buffers (after a ``ValueError`` its content is undefined).
    Without ``out``, fp32 decoding returns a view of ``parts["data"]`` (no copy).
    """
    _check_codec(codec)
    _check_block(codec, block)
    if not isinstance(parts, Mapping):
        raise ValueError(f"{codec} parts must be a mapping of tensors, got {type(parts).__name__}")
    numel = _shape_numel(shape)
    dims = tuple(shape)
    expected = {"data"} if codec in ("fp32", "bf16") else {"q", "scale"}
    if set(parts) != expected:
        raise ValueError(f"{codec} parts have keys {sorted(parts)}, expected {sorted(expected)}")
    if out is not None and (
        out.dtype != torch.float32 or tuple(out.shape) != dims or not out.is_contiguous()
    ):
        raise ValueError(f"out must be a contiguous float32 tensor of shape {list(dims)}")

    if codec in ("fp32", "bf16"):
        data_dtype = torch.float32 if codec == "fp32" else torch.bfloat16
        data = parts["data"]
        if isinstance(data, Tensor) and data.dim() != 1 and tuple(data.shape) == dims:
            data = data.reshape(-1)  # accept the natural shape as well as the flat one encode writes
        data = _part({"data": data}, "data", data_dtype, numel, codec)
        if not all_finite(data):
            raise ValueError(f"{codec} data holds NaN/Inf values")
        if out is None:
            return data.view(dims) if codec == "fp32" else data.view(dims).float()
        return out.copy_(data.view(dims))

    _check_byteorder()
    bits, L = _INT[codec]
    n_full, tail = divmod(numel, block)
    n_blocks = n_full + (tail > 0)
    q = _part(parts, "q", torch.uint8, n_blocks * block * bits // 8, codec)
    scale = _part(parts, "scale", torch.float32, n_blocks, codec)
    if n_blocks and not bool(torch.isfinite(scale).all()):
        raise ValueError(f"{codec} scales hold NaN/Inf values")
    if n_blocks and bool((scale < 0).any()):
        raise ValueError(f"{codec} scales must be >= 0 (absmax / {L}), found negative ones")
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
        decode_rows(
            q[r0 * bytes_per_block : r1 * bytes_per_block],
            scale[r0:r1],
            dst.view(r1 - r0, block),
            codec,
            cbuf,
        )
    if last is not None:
        flat[n_full * block :] = last[:tail]
    return out


def decode_rows(q: Tensor, scale: Tensor, y: Tensor, codec: str, cbuf: Tensor) -> Tensor:
    """Decode whole blocks of an int codec: ``q`` (rows × bytes per block,) uint8 and ``scale`` (rows,) into
    ``y`` (rows, block) fp32; ``cbuf`` is a uint8 buffer of at least ``y.numel()``."""
    bits, L = _INT[codec]
    codes = cbuf[: y.numel()]
    _unpack(q, codes, bits, y.shape[1])
    if int(codes.max()) > 2 * L:
        raise ValueError(f"{codec} codes out of range (> {2 * L}) in these {y.shape[0]} blocks")
    # Back to two's complement in uint8 arithmetic (mod 256), then one int8 -> fp32 cast and one multiply.
    signed = codes.sub_(L).view(torch.int8).view_as(y)
    return y.copy_(signed).mul_(scale[:, None])


_RANGE_STEP = 1 << 20
"""Packed bytes per chunk of `codes_in_range` (1 MiB: the chunk and its masked copy stay in cache)."""


def codes_in_range(q: Tensor, codec: str) -> bool:
    """Whether every code packed in ``q`` (uint8) is at most 2L, without unpacking. A code is out of range iff
    all its bits are set (2**bits − 1, the only value above 2L), so per chunk of bytes: the top code of a byte
    is iff the byte is ≥ that pattern shifted to the top; each lower code iff the byte masked to its bits
    reaches the mask. Byte-wide max reductions (32 bytes per AVX2 instruction): 3.6× faster at int4 than
    ANDing shifted 64-bit words (one 1b answer's 24 MB: 3.0 against 10.6 ms)."""
    bits, L = _INT[codec]
    if q.numel() == 0:
        return True
    if bits == 8:
        return int(q.max()) <= 2 * L
    code = (1 << bits) - 1
    top = code << (8 - bits)
    masks = [code << (bits * m) for m in range(8 // bits - 1)]
    flat = q.reshape(-1)
    buf = torch.empty(min(_RANGE_STEP, flat.numel()), dtype=torch.uint8, device=q.device)
    for i in range(0, flat.numel(), _RANGE_STEP):
        c = flat[i : i + _RANGE_STEP]
        if int(c.max()) >= top:
            return False
        for m in masks:
            if int(torch.bitwise_and(c, m, out=buf[: c.numel()]).max()) == m:
                return False
    return True
