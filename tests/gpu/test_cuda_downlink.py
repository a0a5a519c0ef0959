"""Download deltas applied on a CUDA device give bit for bit what the syncer computed on the CPU
(`ddiloco.run.downlink.apply_delta`: one fp32 add, then bf16 rounding).

Run with `pytest -m gpu tests/gpu`; skipped without a CUDA device.
"""

from __future__ import annotations

import pytest
import torch

from ddiloco.run.downlink import apply_delta, decode_delta, encode_step

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_a_delta_applied_on_cuda_matches_the_cpu_bit_for_bit(dtype, codec):
    g = torch.Generator().manual_seed(0)
    held = {"w": torch.randn(1000, 333, generator=g)}
    if dtype == "bf16":
        held = {n: t.to(torch.bfloat16).float() for n, t in held.items()}
    on_cuda = {n: t.cuda() for n, t in held.items()}
    for _ in range(20):
        theta = {n: t + 1e-3 * torch.randn(t.shape, generator=g) for n, t in held.items()}
        step = encode_step(held, theta, codec, dtype)  # the syncer, on the CPU
        shapes = {n: list(t.shape) for n, t in held.items()}
        parts = decode_delta(step.parts, shapes, codec)  # what a learner decodes, on the CPU
        on_cuda = {n: apply_delta(on_cuda[n], parts[n], dtype) for n in held}
        for n in held:
            assert torch.equal(on_cuda[n].cpu().view(torch.int32), step.values[n].view(torch.int32))
        held = step.values
