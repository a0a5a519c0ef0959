"""The learner on a CUDA device: the CPU loss curve in fp32, bf16 tracking it (with MFU and device memory),
asynchronous snapshots that see exactly the values of their step boundary, a fused-AdamW restart from a
checkpoint, torch.compile.

Run with `pytest -m gpu tests/gpu`; every test is skipped without a CUDA device.
"""

from __future__ import annotations

import pytest
import torch

from ddiloco.learner.accel import HostCopier
from ddiloco.learner.loop import Learner
from ddiloco.platform import peaks
from tests._curves import losses, prepared

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_cpu_and_cuda_follow_the_same_loss_curve_in_fp32():
    cpu, _ = losses(prepared("gpu-parity-cpu", "train.precision=fp32"), "cpu")
    cuda, learner = losses(prepared("gpu-parity-cuda", "train.precision=fp32"), "cuda")
    assert learner.device.type == "cuda" and learner.precision == "fp32"
    assert learner.opt.param_groups[0]["fused"]  # fused AdamW on CUDA
    assert cpu[-1] < cpu[0] - 0.5  # the curve really moves
    assert max(abs(a - b) for a, b in zip(cpu, cuda, strict=True)) < 2e-3, (cpu, cuda)


def test_bf16_on_cuda_tracks_fp32():
    fp32, _ = losses(prepared("gpu-fp32", "train.precision=fp32"), "cuda")
    bf16, learner = losses(prepared("gpu-bf16", "train.precision=auto"), "cuda")
    if not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bf16")
    assert learner.precision == "bf16" and fp32 != bf16
    figures = learner.efficiency.figures()  # issue 52: device memory and MFU from the data-sheet table
    assert figures["peak_memory_kind"] == "cuda_max_allocated" and figures["peak_memory_bytes"] > 0
    assert figures["device_name"] == torch.cuda.get_device_name()
    if peaks.lookup(figures["device_name"], "bf16").flops is not None:  # a GPU in ddiloco.platform.peaks
        assert 0 < figures["mfu"] < 1 and "data sheet" in figures["peak_flops_source"]
    late = slice(-10, None)
    assert abs(sum(fp32[late]) - sum(bf16[late])) / 10 < 0.03 * sum(fp32[late]) / 10, (fp32, bf16)


def test_snapshots_see_their_step_boundary_and_never_later_writes():
    dev = torch.device("cuda", torch.cuda.current_device())
    copier = HostCopier(dev)
    a = torch.randn(2048, 2048, device=dev)
    x = torch.randn(1 << 22, device=dev)
    for _ in range(20):  # keep the compute stream busy so a missing wait would show
        a = a @ a / 2048**0.5
    x.mul_(2.0)  # queued before the snapshot: must be in it
    snap = copier.snapshot({"x": x})
    expected = x.cpu()  # (synchronises; a reference copy taken on the compute stream)
    copier.fence()
    x.add_(1.0)  # queued after the fence: must not be in it
    got = snap.wait()["x"]
    assert got.is_pinned() and torch.equal(got, expected)
    ptr = got.data_ptr()
    snap.release()
    again = copier.snapshot({"x": x})
    assert again.wait()["x"].data_ptr() == ptr  # pinned buffers are reused
    torch.testing.assert_close(again.tensors["x"], expected + 1.0)


def test_restart_from_a_checkpoint_with_fused_adamw_on_cuda():
    store = prepared("gpu-ckpt", "train.checkpoint_every_s=0", "train.precision=fp32")
    first = Learner.open(store, 0, device="cuda")
    first.start()
    for _ in range(4):
        first.tick()
    first.close("max_steps")
    second = Learner.open(store, 0, device="cuda")
    second.start()
    assert second.inner_step > 0  # restored
    steps = [s["step"] for s in second.opt.state.values()]
    assert steps and all(t.device.type == "cuda" for t in steps)  # fused AdamW keeps them on the GPU
    for _ in range(3):
        second.tick()
    second.close("max_steps")
    assert second.loss is not None and second.loss == second.loss


def test_compiled_learner_matches_eager():
    eager, _ = losses(prepared("gpu-eager", "train.precision=fp32"), "cuda", 8)
    compiled, learner = losses(
        prepared("gpu-compiled", "train.precision=fp32", "train.compile=true"), "cuda", 8
    )
    assert learner.net is not learner.model
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), rtol=1e-3, atol=1e-3)
