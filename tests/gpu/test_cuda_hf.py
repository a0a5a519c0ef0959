"""A Hugging Face model in a learner on a CUDA device (`ddiloco.model.hf.model`): the CPU loss curve in fp32 for a
dense Llama, a mixture-of-experts Qwen3 and the newest Gemma text model (tiny configs built in the test), bf16
tracking fp32, and attention through SDPA's flash kernel under bf16.

Run with `pytest -m gpu tests/gpu`; every test is skipped without a CUDA device.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests._curves import losses, prepared
from tests._hf import tiny_hf_dir

pytest.importorskip("transformers")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _store(tmp_path: Path, name: str, model_type: str, *overrides: str):
    d = tiny_hf_dir(tmp_path / model_type, model_type)
    return prepared(name, "model.seq_len=32", f"model.hf={d}", *overrides)


@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe", "gemma4_text"])
def test_cpu_and_cuda_follow_the_same_loss_curve_in_fp32(tmp_path, model_type):
    cpu, _ = losses(_store(tmp_path, f"gpu-hf-{model_type}-cpu", model_type, "train.precision=fp32"), "cpu")
    cuda, learner = losses(
        _store(tmp_path, f"gpu-hf-{model_type}-cuda", model_type, "train.precision=fp32"), "cuda"
    )
    assert learner.device.type == "cuda" and learner.precision == "fp32"
    assert learner.model.lm.config._attn_implementation == "sdpa"
    assert learner.opt.param_groups[0]["fused"]  # fused AdamW on CUDA
    assert cpu[-1] < cpu[0] - 0.5  # the curve really moves
    assert max(abs(a - b) for a, b in zip(cpu, cuda, strict=True)) < 5e-3, (cpu, cuda)


def test_bf16_on_cuda_tracks_fp32_and_attends_with_the_flash_kernel(tmp_path):
    if not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bf16")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    fp32, _ = losses(_store(tmp_path, "gpu-hf-fp32", "llama", "train.precision=fp32"), "cuda")
    bf16, learner = losses(_store(tmp_path, "gpu-hf-bf16", "llama", "train.precision=auto"), "cuda")
    assert learner.precision == "bf16" and fp32 != bf16
    late = slice(-10, None)
    assert abs(sum(fp32[late]) - sum(bf16[late])) / 10 < 0.03 * sum(fp32[late]) / 10, (fp32, bf16)
    x, y = learner.loader.next_batch()
    x, y = x.cuda(), y.cuda()
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]), torch.autocast("cuda", dtype=torch.bfloat16):
        _, loss = learner.model(x, y)  # raises "No available kernel" if transformers' call rules flash out
    assert torch.isfinite(loss)
