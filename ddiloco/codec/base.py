"""The `Codec` base class: what learners, the syncer, the config checks and the bandwidth planner need of a
tensor codec, so none of them branches on a codec's name; and the numeric helpers every family shares.

A codec turns a floating tensor into flat CPU parts (``{part name: tensor}``, ready for safetensors) and back.
Parts are untrusted when read: `decode` and `check` raise ``ValueError`` naming the problem. The syncer keeps
an answer encoded until it merges (`ddiloco.codec.encoded`): `check` validates it whole before any value is used,
`accumulate` adds it to a running sum in one pass (measuring its norm there), `decode_range` decodes a
block-aligned slice. `part_specs` is what a payload must hold (names, dtypes, sizes: checked before anything
else), `bits` and `scaled` what the bandwidth planner counts. Families: `ddiloco.codec.float`,
`ddiloco.codec.blockwise`; codecs by name: `ddiloco.codec.registry`.

Norms are fp64 sums over 128-value rows of fp32 row norms: as fast as one fp32 dot product per chunk, which is
off by ~3e-6 per 512Ki values, while one fp32 reduction over a whole 48M-value tensor is off by 0.6%. A
learner's claimed norm and the syncer's measurement are the same computation (`accumulate` without the add).
"""

from __future__ import annotations

import abc
import math
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

BLOCK = 128
"""Values per block: the unit of scales (blockwise codecs), of row norms and of `decode_range` offsets."""
CPU_CHUNK = 1 << 19
"""Values per chunk of CPU encoding and decoding (512Ki, 2 MiB of fp32): temporaries stay in cache, and
per-op dispatch (~3-5 us, some 12 ops a chunk) stays small next to the work (measured best of 64Ki..2Mi)."""
MERGE_CHUNK = 1 << 20
"""Values per chunk of `Codec.accumulate` (4 MiB of fp32): the per-chunk work stays in cache and the ~8 torch
calls of a chunk cost little next to it (512Ki-2Mi measured best at the 1b preset's fragments, 1Mi best on
1 and 2 threads)."""
FLT_MAX = 3.4028234663852886e38


class Checked(NamedTuple):
    """What `Codec.check` found: the flat parts, an upper bound on ‖values‖ read from them (inf: none)
    and ‖values‖ when the check measured it (None otherwise)."""

    parts: dict[str, Tensor]
    bound: float
    norm: float | None


class Codec(abc.ABC):
    """A tensor codec of the wire. Subclasses set `name` and `bits` and implement the abstract methods;
    `ddiloco.codec.registry.register` makes one known by name."""

    name: str
    bits: float
    """Payload bits per value, block scales aside (the bandwidth planner's figure)."""
    scaled: bool = False
    """Whether the payload holds one scale per block of values (the planner adds its bits per value)."""
    upload: bool = True
    """Learners may upload deltas in it (`diloco.codec`)."""
    download: bool = False
    """The syncer may publish download deltas in it (`diloco.download_codec`, `ddiloco.run.downlink`)."""
    packing: str | None = None
    """How codes sit in their bytes, which a payload's header must name (`ddiloco.protocol.validation.packing`);
    None: nothing to check."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"

    def check_block(self, block: int) -> None:
        """``ValueError`` unless `block` is a block size this codec can encode with."""
        if isinstance(block, bool) or not isinstance(block, int) or block < 1:
            raise ValueError(f"block must be a positive integer, got {block!r}")

    @abc.abstractmethod
    def part_specs(self, numel: int, block: int = BLOCK) -> dict[str, tuple[torch.dtype, int]]:
        """Part name -> (dtype, number of values) of an encoding of `numel` values."""

    def nbytes(self, numel: int, *, block: int = BLOCK) -> int:
        """Payload bytes of one encoded tensor of `numel` values (bandwidth accounting)."""
        self.check_block(block)
        if numel < 0:
            raise ValueError(f"numel must be >= 0, got {numel}")
        return sum(dtype.itemsize * n for dtype, n in self.part_specs(numel, block).values())

    @abc.abstractmethod
    def encode(self, x: Tensor, *, block: int = BLOCK) -> dict[str, Tensor]:
        """`x` (any shape, floating) as contiguous flat CPU parts; ``ValueError`` for NaN/Inf values."""

    @abc.abstractmethod
    def decode(
        self,
        parts: Mapping[str, Tensor],
        shape: Sequence[int],
        *,
        block: int = BLOCK,
        out: Tensor | None = None,
    ) -> Tensor:
        """Untrusted `parts` as an fp32 tensor of `shape` (into `out`, contiguous fp32 of `shape`, when
        given: its content is undefined after a ``ValueError``)."""

    @abc.abstractmethod
    def check(
        self, parts: Mapping[str, Tensor], numel: int, *, measure: bool = False, buf: Tensor | None = None
    ) -> Checked:
        """Validate untrusted parts of `numel` values (block `BLOCK`) whole, so that `accumulate` can
        never fail or overflow; ``ValueError`` naming the problem. `measure`: measure the norm in the same
        pass where that saves one (`buf`: `chunk_buffer`)."""

    @abc.abstractmethod
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
        """``flat += alpha * values`` (``=`` when `overwrite`; None: no add) in one pass over checked parts;
        returns ‖values‖ when `measure` (else None)."""

    @abc.abstractmethod
    def decode_range(
        self, parts: Mapping[str, Tensor], out: Tensor, start: int, alpha: float, buf: Tensor | None
    ) -> Tensor:
        """``alpha × values[start : start + out.numel()]`` into `out` (flat contiguous fp32) from checked
        parts; `start` a multiple of `BLOCK`."""

    def decode_args(
        self, parts: Mapping[str, Tensor], shape: Sequence[int], block: int, out: Tensor | None
    ) -> tuple[int, tuple[int, ...]]:
        """(numel, dims) of a `decode` call once its block, parts' names, shape and `out` are checked."""
        self.check_block(block)
        if not isinstance(parts, Mapping):
            raise ValueError(f"{self.name} parts must be a mapping of tensors, got {type(parts).__name__}")
        numel = shape_numel(shape)
        dims = tuple(shape)
        expected = set(self.part_specs(numel, block))
        if set(parts) != expected:
            raise ValueError(f"{self.name} parts have keys {sorted(parts)}, expected {sorted(expected)}")
        if out is not None and (
            out.dtype != torch.float32 or tuple(out.shape) != dims or not out.is_contiguous()
        ):
            raise ValueError(f"out must be a contiguous float32 tensor of shape {list(dims)}")
        return numel, dims


def floating(x: Tensor) -> Tensor:
    """`x` flat (a view where possible), or ``ValueError`` unless it is a floating-point tensor."""
    if not isinstance(x, Tensor) or not x.is_floating_point():
        raise ValueError(f"encode expects a floating-point tensor, got {getattr(x, 'dtype', type(x))}")
    return x.detach().reshape(-1)


def part(parts: Mapping[str, Tensor], key: str, dtype: torch.dtype, length: int, codec: str) -> Tensor:
    """``parts[key]`` as a contiguous tensor, or ``ValueError`` unless it has `dtype` and `length` values."""
    t = parts[key]
    if not isinstance(t, Tensor):
        raise ValueError(f"{codec} part {key!r} is a {type(t).__name__}, expected a tensor")
    if t.dtype != dtype:
        raise ValueError(f"{codec} part {key!r} has dtype {t.dtype}, expected {dtype}")
    if t.dim() != 1 or t.numel() != length:
        raise ValueError(f"{codec} part {key!r} has shape {list(t.shape)}, expected [{length}]")
    return t.contiguous()


def shape_numel(shape: Sequence[int]) -> int:
    try:
        dims = tuple(shape)
    except TypeError:
        raise ValueError(f"shape must be a sequence of integers, got {shape!r}") from None
    for d in dims:
        if isinstance(d, bool) or not isinstance(d, int) or d < 0:
            raise ValueError(f"shape must hold non-negative integers, got {list(dims)!r}")
    return math.prod(dims)


def all_finite(x: Tensor) -> bool:
    """Whether `x` holds no NaN/Inf, exactly. One streaming sum decides almost always (NaN and Inf
    propagate through it); ``isfinite(x).all()`` would allocate a bool tensor as large as x (48 MB and
    ~0.2 s of page faults for a 1b fragment), and ``sum(dtype=...)`` a converted copy. Only a sum past
    the dtype's range (or a NaN/Inf) takes the exact chunked check."""
    if x.numel() == 0 or bool(torch.isfinite(x.sum())):
        return True
    flat = x.reshape(-1)
    return all(bool(torch.isfinite(flat[i : i + CPU_CHUNK]).all()) for i in range(0, flat.numel(), CPU_CHUNK))


def chunk_buffer() -> Tensor:
    """A decode buffer for `Codec.accumulate` (one per thread)."""
    return torch.empty(MERGE_CHUNK, dtype=torch.float32)


def scratch(buf: Tensor | None, n: int) -> Tensor:
    """`n` fp32 values of `buf`, or fresh ones when it is missing or too small."""
    if buf is None or buf.numel() < n:
        return torch.empty(n, dtype=torch.float32)
    return buf[:n]


def sumsq(c: Tensor) -> float:
    """Σ c² of an fp32 chunk: fp32 norms of 128-value rows, squared and summed in fp64."""
    k = c.numel() - c.numel() % BLOCK
    total = 0.0
    if k:
        total += float(torch.linalg.vector_norm(c[:k].view(-1, BLOCK), dim=1).double().square().sum())
    if k < c.numel():
        total += float(c[k:].double().square().sum())
    return total


def norm64(t: Tensor) -> float:
    """‖t‖ of an fp32 tensor as `Codec.accumulate` measures it (chunked, fp64 sum)."""
    flat = t.reshape(-1)
    return math.sqrt(sum(sumsq(flat[i : i + MERGE_CHUNK]) for i in range(0, flat.numel(), MERGE_CHUNK)))
