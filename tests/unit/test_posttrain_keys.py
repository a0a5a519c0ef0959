"""A signed run's evaluate and SFT refuse a final model that does not verify under the run key (issue 15).

The run is prepared with a master key; its final model is then written three ways: signed with the run key
(accepted), signed with another key, and unsigned. `ddiloco evaluate` and `ddiloco sft` with DDILOCO_RUN_KEY
set must refuse the last two before using them, with one line on stderr that names the object and says what
to set, and exit 2. Before the run root owned its key, both loaded the final model without verifying it.
"""

from __future__ import annotations

import pytest

from ddiloco import keys
from ddiloco.cli.main import main
from ddiloco.protocol import signing, wire
from ddiloco.run.globalmodel import build_model
from ddiloco.run.prepare import prepare
from ddiloco.run.root import RunRoot
from ddiloco.store.url import open_store
from tests._harness import tiny_config

MASTER = bytes(range(32))
OTHER = bytes(range(1, 33))
SECTIONS = (
    "eval.items_per_task=2",
    "eval.tasks=[arithmetic]",
    "sft.base=final",
    "sft.steps=1",
    "sft.batch_size=2",
    "sft.items_per_kind=4",
    "sft.eval_items=2",
)


@pytest.fixture()
def signed_run(tmp_path, monkeypatch: pytest.MonkeyPatch) -> RunRoot:
    url = f"file://{tmp_path}/signed"
    cfg = tiny_config("signed", *SECTIONS)
    prepare(open_store(url), cfg, secret=MASTER)
    monkeypatch.setenv(signing.ENV_VAR, MASTER.hex())
    return RunRoot(open_store(url), cfg.run_id, signing.for_run(MASTER, cfg.run_id))


def _write_final(root: RunRoot, key: bytes | None) -> None:
    model = build_model(root.layout())
    tensors = {n: p.detach().float() for n, p in model.named_parameters()}
    header = {"run_id": root.run_id, "kind": "final", "versions": [0] * root.layout().num_fragments}
    root.store.put(keys.FINAL_MODEL, wire.pack(tensors, header, key=key))


def _one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize("command", ["evaluate", "sft"])
@pytest.mark.parametrize("writer", ["another key", "unsigned"])
def test_signed_run_refuses_a_final_model_that_does_not_verify(signed_run, capsys, command, writer):
    other = signing.for_run(OTHER, signed_run.run_id) if writer == "another key" else None
    _write_final(signed_run, other)
    assert main([command, "--store", signed_run.url]) == 2
    line = _one_error_line(capsys)
    assert keys.FINAL_MODEL in line and "does not verify" in line, line
    assert signing.ENV_VAR in line, "the error says what to set"
    assert not signed_run.store.exists(keys.SFT_MODEL) and not signed_run.store.list("eval/")


def test_signed_run_evaluates_a_final_model_signed_with_its_own_key(signed_run):
    _write_final(signed_run, signed_run.key)
    assert main(["evaluate", "--store", signed_run.url, "--name", "ok"]) == 0
    assert signed_run.store.exists(keys.eval_key("ok"))


def test_the_fine_tuned_model_is_signed_with_the_run_key(signed_run):
    _write_final(signed_run, signed_run.key)
    assert main(["sft", "--store", signed_run.url]) == 0
    blob = signed_run.store.get(keys.SFT_MODEL)
    wire.unpack(blob, key=signed_run.key)  # verifies, or raises PayloadError
    with pytest.raises(wire.PayloadError):
        wire.unpack(blob, key=signing.for_run(OTHER, signed_run.run_id))
