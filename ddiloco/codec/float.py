"""Float codecs: the values themselves, rounded to a floating dtype (fp32: exact; bf16: half the bytes at
round-to-nearest-even, 8 significant bits). One part, ``{"data": (numel,)}`` in that dtype.

``encode`` refuses NaN/Inf values (a diverged learner; values past the dtype's range round to Inf), and what
is read is refused when it holds any. The syncer's check measures the norm anyway (the data is read once
to find NaN/Inf), so a float answer needs no pass of its own to be measured.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from ddiloco.codec.base import (
    BLOCK,
    FLT_MAX,
    MERGE_CHUNK,
    Checked,
    Codec,
    all_finite,
    floating,
    part,
    scratch,
    sumsq,
)


class FloatCodec(Codec):
    """The values in `dtype`: `encode` rounds them (fp32 on the CPU: a view of the input when it is fp32,
    so clone it first if it will change before the bytes are written), `decode` reads them back as fp32
    (fp32 without `out`: a view of the part, no copy)."""

    def __init__(self, name: str, dtype: torch.dtype, *, upload: bool = True, download: bool = False) -> None:
        if not dtype.is_floating_point:
            raise ValueError(f"a float codec needs a floating dtype, got {dtype}")
        self.name, self.dtype, self.upload, self.download = name, dtype, upload, download
        self.bits = float(dtype.itemsize * 8)

    def part_specs(self, numel: int, block: int = BLOCK) -> dict[str, tuple[torch.dtype, int]]:
        return {"data": (self.dtype, numel)}

    def encode(self, x: Tensor, *, block: int = BLOCK) -> dict[str, Tensor]:
        self.check_block(block)
        data = floating(x).to(self.dtype)
        if not all_finite(data):
            raise ValueError(
                f"cannot encode a tensor with NaN/Inf values ({self.name}); the learner has diverged"
            )
        return {"data": data.cpu().contiguous()}

    def decode(
        self,
        parts: Mapping[str, Tensor],
        shape: Sequence[int],
        *,
        block: int = BLOCK,
        out: Tensor | None = None,
    ) -> Tensor:
        numel, dims = self.decode_args(parts, shape, block, out)
        data = parts["data"]
        if isinstance(data, Tensor) and data.dim() != 1 and tuple(data.shape) == dims:
            data = data.reshape(-1)  # accept the natural shape as well as the flat one encode writes
        data = part({"data": data}, "data", self.dtype, numel, self.name)
        if not all_finite(data):
            raise ValueError(f"{self.name} data holds NaN/Inf values")
        if out is None:
            return data.view(dims) if self.dtype == torch.float32 else data.view(dims).float()
        return out.copy_(data.view(dims))

    def check(
        self, parts: Mapping[str, Tensor], numel: int, *, measure: bool = False, buf: Tensor | None = None
    ) -> Checked:
        """The data's size, and its norm measured (finite, and its square within fp32: NaN/Inf otherwise).
        The norm is returned as the bound (an upper bound, met exactly)."""
        data = parts["data"].reshape(-1)
        if data.numel() != numel:
            raise ValueError(f"{self.name} data has {data.numel()} values, expected {numel}")
        n = self.accumulate({"data": data}, numel, None, 0.0, None, overwrite=False, measure=True)
        if n is None or not math.isfinite(n) or n > FLT_MAX:
            raise ValueError(f"{self.name} data holds NaN/Inf values (or values whose square overflows fp32)")
        return Checked({"data": data}, n, None)

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
    ) -> float | None:
        """Chunk by chunk: non-fp32 data is widened into `buf` first (exact), measured there, added."""
        total = 0.0
        data = parts["data"]
        for i in range(0, numel, MERGE_CHUNK):
            c = data[i : i + MERGE_CHUNK]
            if c.dtype != torch.float32:
                c = scratch(buf, c.numel()).copy_(c)
            if measure:
                total += sumsq(c)
            if flat is None:
                continue
            if overwrite:
                torch.mul(c, alpha, out=flat[i : i + c.numel()])
            else:
                flat[i : i + c.numel()].add_(c, alpha=alpha)
        return math.sqrt(total) if measure else None

    def decode_range(
        self, parts: Mapping[str, Tensor], out: Tensor, start: int, alpha: float, buf: Tensor | None
    ) -> Tensor:
        out.copy_(parts["data"][start : start + out.numel()])
        return out.mul_(alpha) if alpha != 1.0 else out


FP32 = FloatCodec("fp32", torch.float32)
BF16 = FloatCodec("bf16", torch.bfloat16)
FAMILY = (FP32, BF16)
"""This family's codecs, in the order the registry lists them."""
