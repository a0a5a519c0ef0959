"""`ddiloco baseline` (data-parallel, the parity yardstick) on a CUDA device: one NCCL rank trains the model a
gloo rank trains on the CPU from the same prepared run, to fp32 tolerance.

Run with `pytest -m gpu tests/gpu`; every test is skipped without a CUDA device.
"""

from __future__ import annotations

import math

import pytest
import torch

from ddiloco.baseline import load_baseline_model, run_baseline
from ddiloco.run.globalmodel import read_layout
from ddiloco.run.prepare import prepare
from ddiloco.store.url import open_store
from tests._harness import tiny_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _baseline(tmp_path, device: str):
    cfg = tiny_config(f"dp-{device}", "train.precision=fp32", "train.warmup_steps=3")
    url = f"file://{tmp_path}/dp-{device}"
    store = open_store(url)
    prepare(store, cfg)
    tokens = 9 * cfg.train.batch_size * cfg.model.seq_len
    s = run_baseline(url, learners=1, tokens=tokens, device=device, timeout=180, tasks=False)
    return s, load_baseline_model(store, cfg.run_id, read_layout(store))


def test_one_nccl_rank_on_cuda_trains_what_one_gloo_rank_trains_on_the_cpu(tmp_path):
    cpu, cpu_model = _baseline(tmp_path, "cpu")
    cuda, cuda_model = _baseline(tmp_path, "cuda")
    assert (cpu["backend"], cuda["backend"]) == ("gloo", "nccl")
    assert cpu["steps"] == cuda["steps"] == 9 and cuda["status"] == "done"
    assert cuda["final_val_loss"] < cuda["initial_val_loss"]
    assert math.isclose(cpu["final_val_loss"], cuda["final_val_loss"], rel_tol=1e-3)
    for (name, a), (_, b) in zip(
        sorted(cpu_model.named_parameters()), sorted(cuda_model.named_parameters()), strict=True
    ):
        torch.testing.assert_close(a.cpu(), b.cpu(), atol=1e-4, rtol=1e-3, msg=name)
