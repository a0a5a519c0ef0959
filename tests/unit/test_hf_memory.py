"""Which memory `prepare` holds a `model.hf` model's training state against (ddiloco.model.hf.prepare)."""

import pytest
import torch

pytest.importorskip("transformers")


def test_the_learners_memory_is_judged_only_where_this_machine_can_see_it(monkeypatch):
    from ddiloco.model.hf.prepare import device_memory

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    host, where = device_memory("cpu")
    assert host > 1 << 30 and where == "host memory"
    assert device_memory("auto") == (host, "host memory")  # a laptop run: the learners share this CPU
    assert device_memory("cuda") == (None, "GPU memory")  # GPU learners, prepared on a CPU machine
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    assert device_memory("auto") == (None, "GPU memory")  # a CPU prepare pod says nothing of the learners'
    assert device_memory("cpu") == (host, "host memory")
