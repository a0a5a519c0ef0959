"""What `tests/gpu`'s device-parity tests stand on, held on CPU where CI runs: two runs prepared from one
config give a learner the same loss curve bit for bit (the built-in GPT and a Hugging Face Llama), and a
second learner on the same run does not (it resumes the first's data cursor), which is why each curve there
gets a store of its own (`tests/_curves.py`)."""

from __future__ import annotations

import pytest

from tests._curves import losses, prepared
from tests._hf import tiny_hf_dir


@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_two_runs_prepared_from_one_config_give_the_same_curve_and_one_run_twice_does_not(tmp_path, model):
    extra = [] if model == "gpt" else ["model.seq_len=32", f"model.hf={tiny_hf_dir(tmp_path / model, model)}"]
    one = prepared(f"curve-{model}-a", "train.precision=fp32", *extra)
    a, _ = losses(one, "cpu")
    b, _ = losses(prepared(f"curve-{model}-b", "train.precision=fp32", *extra), "cpu")
    assert a == b and a[-1] < a[0] - 0.5
    again, learner = losses(one, "cpu")
    assert learner.incarnation == 1 and again != a  # the same weights at step 0, later batches
