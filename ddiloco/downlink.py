"""Compressed downloads: each global version is also published as a quantized delta against the previous one.

With int4 uploads a learner would otherwise download ~8x what it uploads (full fp32 fragments). Symbols:
Θ_v is the syncer's fp32 master after version v's outer step; L_v are the values learners hold for v.

    L_0 = the values prepare published (v0 is always full)
    D_v = Q(Θ_v − L_{v−1})                  blockwise int8/int4/int2 codes + fp32 scales (`ddiloco.compression`)
    L_v = round_dtype(L_{v−1} + deq(D_v))   one fp32 add per element, then bf16 rounding for bf16 globals

Design choices:
- Error feedback by construction: the delta is taken against L_{v−1}, what learners hold, not against
  Θ_{v−1}, so the residual Θ_{v−1} − L_{v−1} is carried into the next delta and never accumulates. After
  every version |Θ_v − L_v| ≤ half a quantization step of D_v per element (plus half a bf16 ulp of L_v with
  bf16 globals); deltas of Θ_v − Θ_{v−1} instead would drift like a random walk (tests show both).
- The published *full* version v is L_v itself (`encode_step` returns it): a learner that applies D_v to
  L_{v−1} and a learner that fetches version v hold bit-identical values, and the bases the syncer takes
  answers against (`GlobalFragment.recent`) are L_v. The fp32 master stays on the syncer (persisted per
  version by `ddiloco.syncer.state`), as with bf16 globals.
- Deterministic elementwise: `deq` is decoded on the CPU by `compression.decode` (int -> fp32 cast, one fp32
  multiply by the block scale), shipped as fp32, and `apply_delta` does a plain IEEE fp32 add (correctly
  rounded on CPU and CUDA alike, no FMA, no reduction) followed by round-to-nearest-even to bf16 when the
  globals are bf16. The syncer computes L_v with the same two functions, so CPU and CUDA learners agree
  bit for bit with it.
- Identity of a base: a delta names its base version and the SHA-256 of L_{v−1} exactly as the full payload
  of v−1 stores it (`wire.data_sha256`: the data region `wire.pack` checksums), and the SHA-256 of L_v. A
  learner applies a delta only to the version *and digest* it holds; anything else is refused and the full
  version fetched instead.
- Codec `none` (`diloco.download_codec`) publishes full versions only: L_v = round_dtype(Θ_v), as before.
- Pure tensor code: no store, no I/O (`ddiloco.globalmodel` reads and writes the payloads).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ddiloco import compression
from ddiloco.config import DOWNLOAD_CODECS
from ddiloco.protocol import wire

__all__ = ["DOWNLOAD_CODECS", "DeltaStep", "apply_delta", "decode_delta", "digest", "encode_step"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
STEP_CHUNK = 1 << 20
"""Values per chunk of `encode_step` (a multiple of the codec block: 4 MiB of fp32 stays in cache)."""

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
    parts themselves, so the syncer gets exactly what a learner decodes. The step runs chunk by chunk of
    `STEP_CHUNK` values (whole blocks, so the codes and scales are those of the whole tensor): Θ − L, its
    codes, their decoding and L + deq of a chunk stay in cache, so no fragment-sized temporary is needed
    (the whole-tensor step borrowed a 193 MB buffer at the 1b preset; the time is the same, 0.21 s per
    fragment on one thread: quantizing, not memory traffic, is what it costs). A caller that owns `held`
    lends `scratch` (fp32, `STEP_CHUNK` values; fewer make more chunks): L_v is then summed into `held`'s
    fp32 tensors, which are overwritten; without it L_v is fresh memory and `held` is untouched."""
    if codec not in DOWNLOAD_CODECS or codec == "none":
        raise ValueError(f"download codec must be one of {', '.join(DOWNLOAD_CODECS[1:])}, got {codec!r}")
    buf = scratch if scratch is not None else torch.empty(STEP_CHUNK, dtype=torch.float32)
    chunk = min(STEP_CHUNK, buf.numel() // compression.BLOCK * compression.BLOCK)  # whole blocks
    if chunk == 0:
        chunk = buf.numel()  # less than a block: only tensors that fit whole
        if any(t.numel() > chunk for t in theta.values()):
            raise ValueError(f"scratch must hold at least {STEP_CHUNK} fp32 values, got {buf.numel()}")
    parts: Tensors = {}
    values: Tensors = {}
    for name in sorted(theta):
        base = held[name].detach().float()  # `held` itself when it is fp32
        if scratch is None and base.data_ptr() == held[name].data_ptr():
            base = base.clone()  # fp32 `held` is not the caller's to give up
        target = theta[name].detach().float().reshape(-1)
        flat = base.view(-1)
        q, scale = _step_chunks(flat, target, codec, dtype, buf[:chunk])
        values[name] = base
        parts[f"{name}/q"], parts[f"{name}/scale"] = q, scale
    return DeltaStep(parts, values)


def _step_chunks(
    flat: torch.Tensor, target: torch.Tensor, codec: str, dtype: str, buf: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One tensor of `encode_step`: `flat` (L_{v−1}) becomes L_v in place; returns the codes and scales."""
    bits = compression._INT[codec][0]
    numel = flat.numel()
    n_blocks = -(-numel // compression.BLOCK)
    q = torch.empty(n_blocks * compression.BLOCK * bits // 8, dtype=torch.uint8)
    scale = torch.empty(n_blocks, dtype=torch.float32)
    step = buf.numel()
    for i in range(0, numel, step):
        j = min(i + step, numel)
        diff = torch.sub(target[i:j], flat[i:j], out=buf[: j - i])
        enc = compression.encode(diff, codec)
        b0 = i // compression.BLOCK
        q[b0 * compression.BLOCK * bits // 8 :][: enc["q"].numel()] = enc["q"]
        scale[b0 : b0 + enc["scale"].numel()] = enc["scale"]
        deq = compression.decode(enc, codec, [j - i], out=diff)  # Θ − L is no longer needed
        chunk = flat[i:j].add_(deq)
        if DTYPES[dtype] != torch.float32:
            chunk.copy_(round_to(chunk, dtype))
    return q, scale


def decode_delta(tensors: Mapping[str, torch.Tensor], shapes: Mapping[str, list[int]], codec: str) -> Tensors:
    """deq(D_v) per tensor name from a payload's parts (untrusted): `ValueError` naming the problem for a
    missing, extra or malformed part. `shapes`: the fragment's tensor names and shapes."""
    expected = {f"{n}/{part}" for n in shapes for part in ("q", "scale")}
    if set(tensors) != expected:
        extra, missing = sorted(set(tensors) - expected)[:3], sorted(expected - set(tensors))[:3]
        raise ValueError(f"delta parts do not match the fragment (extra {extra}, missing {missing})")
    return {
        n: compression.decode({"q": tensors[f"{n}/q"], "scale": tensors[f"{n}/scale"]}, codec, shape)
        for n, shape in shapes.items()
    }


def digest(values: Mapping[str, torch.Tensor], dtype: str) -> str:
    """SHA-256 of `values` as a full global payload of `dtype` stores them (its header's `sha256`)."""
    return wire.data_sha256({n: t.detach().to(DTYPES[dtype]) for n, t in values.items()})
