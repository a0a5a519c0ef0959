"""The learner on a CUDA device: the CPU loss curve in fp32, bf16 tracking it, asynchronous snapshots that
see exactly the values of their step boundary, a fused-AdamW restart from a checkpoint, torch.compile.

Run with `pytest -m gpu tests/gpu`; every test is skipped without a CUDA device.
"""

from __future__ import annotations

import pytest
import torch

from ddiloco.learner.accel import HostCopier
from ddiloco.learner.loop import Learner
from ddiloco.prepare import prepare
from ddiloco.store.url import open_store
from tests._harness import tiny_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

STEPS = 30


def _store(name: str, *overrides: str):
    store = open_store(f"memory://{name}")
    prepare(store, tiny_config(name, "diloco.learners=1", "train.checkpoint_every_s=100000", *overrides))
    return store


def _losses(store, device: str, steps: int = STEPS) -> tuple[list[float], Learner]:
    """Per-step losses of a fresh learner (no syncer: inner steps only)."""
    learner = Learner.open(store, 0, device=device)
    learner.start()
    out = [learner.step() for _ in range(steps)]
    learner.close("max_steps")
    if device == "cuda":  # each step returns the previous step's loss; the last is read at the end
        assert out[0] is None and all(isinstance(v, float) for v in out[1:])
        out = [*out[1:], learner.loss]
    return out, learner


def test_cpu_and_cuda_follow_the_same_loss_curve_in_fp32():
    store = _store("gpu-parity", "train.precision=fp32")
    cpu, _ = _losses(store, "cpu")
    cuda, learner = _losses(store, "cuda")
    assert learner.device.type == "cuda" and learner.precision == "fp32"
    assert learner.opt.param_groups[0]["fused"]  # fused AdamW on CUDA
    assert cpu[-1] < cpu[0] - 0.5  # the curve really moves
    assert max(abs(a - b) for a, b in zip(cpu, cuda, strict=True)) < 2e-3, (cpu, cuda)


def test_bf16_on_cuda_tracks_fp32():
    fp32, _ = _losses(_store("gpu-fp32", "train.precision=fp32"), "cuda")
    bf16, learner = _losses(_store("gpu-bf16", "train.precision=auto"), "cuda")
    if not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bf16")
    assert learner.precision == "bf16" and fp32 != bf16
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
    store = _store("gpu-ckpt", "train.checkpoint_every_s=0", "train.precision=fp32")
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
    eager, _ = _losses(_store("gpu-eager", "train.precision=fp32"), "cuda", 8)
    compiled, learner = _losses(
        _store("gpu-compiled", "train.precision=fp32", "train.compile=true"), "cuda", 8
    )
    assert learner.net is not learner.model
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), rtol=1e-3, atol=1e-3)
