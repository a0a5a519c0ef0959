"""Compressed downloads: each global version is also published as a quantized delta against the previous one.

With int4 uploads a learner would otherwise download ~8x what it uploads (full fp32 fragments). Θ_v is the
syncer's fp32 master after version v's outer step, L_v the values learners hold for v:
D_v = Q(Θ_v − L_{v−1}) (`ddiloco.codec.blockwise`) and L_v = round_dtype(L_{v−1} + deq(D_v)). The delta is
taken against what learners hold, so the quantization error is carried into the next delta and never
accumulates, and the full version published for v is L_v itself. Decoding (on the CPU) and the add are plain
elementwise fp32, so CPU and CUDA learners agree with the syncer bit for bit. A delta names its base's
version and digest and is applied only to exactly that. Pure tensor code: no store, no I/O
(`ddiloco.run.globalmodel` reads and writes the payloads).

Design notes (the error bound, determinism, codec `none`): docs/internals.md, "Compressed downloads".
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ddiloco.codec import registry
from ddiloco.protocol import wire

__all__ = ["DeltaStep", "apply_delta", "decode_delta", "digest", "encode_step"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

Tensors = dict[str, torch.Tensor]


@dataclass(frozen=True, slots=True)
class DeltaStep:
    """One version's download delta: `parts` (`{name}/q`, `{name}/scale`, what the payload stores) and
    `values` (L_v, fp32 tensors exactly representable in the global dtype)."""

    parts: Tensors
    values: Tensors


def round_to(t: torch.Tensor, dtype: str) -> torch.Tensor:
    """`t` (fp32) rounded to the global dtype and back to fp32 (round to nearest even; exact for fp32)."""
    return t.to(torch.bfloat16).float() if DTYPES[dtype] == torch.bfloat16 else t


def apply_delta(held: torch.Tensor, deq: torch.Tensor, dtype: str) -> torch.Tensor:
    """L_v = round_dtype(L_{v−1} + deq): one fp32 add per element on `held`'s device, then rounding."""
    return round_to(torch.add(held, deq.to(held.device, non_blocking=False)), dtype)


def encode_step(
    held: Mapping[str, torch.Tensor],
    theta: Mapping[str, torch.Tensor],
    codec: str,
    dtype: str,
    *,
    scratch: torch.Tensor | None = None,
) -> DeltaStep:
    """Quantize Θ_v − L_{v−1} with `codec` and return the parts and L_v (module docstring).

    `held`: L_{v−1}; `theta`: the fp32 master Θ_v (same names and shapes). `deq` is decoded from the
    parts themselves, so the syncer gets exactly what a learner decodes. At the 1b preset a fragment is
    193 MB and every fresh temporary of its size costs ~0.1 s of page faults, so a caller that owns `held`
    can lend a flat fp32 `scratch` of at least the fragment's size: Θ_v − L_{v−1} and its decoding go
    there, and L_v is summed into `held`'s fp32 tensors, which are overwritten (scratch's content is
    undefined after)."""
    quantize = registry.get(codec, "download")
    parts: Tensors = {}
    values: Tensors = {}
    for name in sorted(theta):
        base = held[name].detach().float()  # `held` itself when it is fp32
        target = theta[name].detach().float()
        if scratch is not None:
            diff = torch.sub(target, base, out=scratch[: base.numel()].view(base.shape))
        else:
            diff = target - base
        enc = quantize.encode(diff)
        deq = quantize.decode(enc, list(base.shape), out=diff)  # Θ − L is no longer needed
        # L_v = apply_delta(base, deq) without another copy: in L_{v−1}'s memory, or in deq's own
        values[name] = round_to(base.add_(deq) if scratch is not None else deq.add_(base), dtype)
        for part, t in enc.items():
            parts[f"{name}/{part}"] = t
    return DeltaStep(parts, values)


def decode_delta(tensors: Mapping[str, torch.Tensor], shapes: Mapping[str, list[int]], codec: str) -> Tensors:
    """deq(D_v) per tensor name from a payload's parts (untrusted): `ValueError` naming the problem for a
    missing, extra or malformed part. `shapes`: the fragment's tensor names and shapes."""
    c = registry.get(codec, "download")
    parts = {n: tuple(c.part_specs(math.prod(shape))) for n, shape in shapes.items()}
    expected = {f"{n}/{part}" for n, names in parts.items() for part in names}
    if set(tensors) != expected:
        extra, missing = sorted(set(tensors) - expected)[:3], sorted(expected - set(tensors))[:3]
        raise ValueError(f"delta parts do not match the fragment (extra {extra}, missing {missing})")
    return {n: c.decode({p: tensors[f"{n}/{p}"] for p in parts[n]}, shape) for n, shape in shapes.items()}


def digest(values: Mapping[str, torch.Tensor], dtype: str) -> str:
    """SHA-256 of `values` as a full global payload of `dtype` stores them (its header's `sha256`)."""
    return wire.data_sha256({n: t.detach().to(DTYPES[dtype]) for n, t in values.items()})
