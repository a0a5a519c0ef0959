"""`ddiloco run`'s default local run on a CUDA machine: with every device left at `auto`, the learner processes
train on the GPU, the syncer merges on the CPU, and evaluation and SFT run on the GPU; the run finishes with its
ledger balanced and SFT improving held-out instructions, as on CPU (`tests/integration/test_local_run.py`).

Run with `pytest -m gpu tests/gpu`; every test is skipped without a CUDA device.
"""

from __future__ import annotations

import pytest
import torch

from ddiloco.launch import LocalRun
from ddiloco.posttrain.stages import posttrain
from ddiloco.protocol import signing
from ddiloco.run.root import RunRoot
from ddiloco.store.url import open_store
from tests._harness import tiny_config
from tests.integration.conftest import RUN_OVERRIDES, TEST_EVAL, TEST_SFT

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_the_default_local_run_trains_evaluates_and_fine_tunes_on_the_gpu(tmp_path):
    cfg = tiny_config("gpu-run", *RUN_OVERRIDES)
    assert (cfg.train.device, cfg.eval.device, cfg.sft.device) == ("auto", "auto", "auto")
    s = LocalRun(cfg, tmp_path).run(timeout=300)
    assert s.status == "done" and s.ledger_balanced and s.tokens_outstanding == 0
    assert s.final_val_loss < s.initial_val_loss
    logs = {p.name: p.read_text() for p in (tmp_path / "gpu-run.logs").glob("learner-*.log")}
    assert len(logs) == cfg.diloco.learners
    assert all("(device cuda:" in text for text in logs.values()), logs

    root = RunRoot.open(
        open_store(str(tmp_path / "gpu-run")),
        signing.parse_key((tmp_path / "gpu-run.key").read_text()),
        role="test",
    )
    torch.cuda.reset_peak_memory_stats()
    fields = posttrain(root, eval_cfg=TEST_EVAL, sft_cfg=TEST_SFT)
    assert torch.cuda.max_memory_allocated() > 0  # evaluation and SFT ran on the GPU
    before, after = fields["instruction_accuracy_before"], fields["instruction_accuracy_after"]
    assert after["all"] > before["all"], (before, after)
    assert fields["sft_val_loss"] < fields["final_val_loss"] + 0.5
