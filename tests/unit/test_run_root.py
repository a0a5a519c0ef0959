"""The run root verifies by default: post-training refuses models and data that do not carry the run's key."""

from __future__ import annotations

import pytest
import torch

from ddiloco import keys
from ddiloco.config.run import EvalConfig, SFTConfig
from ddiloco.errors import ConfigError
from ddiloco.posttrain.evaluate import evaluate_checkpoint
from ddiloco.posttrain.sft import run_sft
from ddiloco.posttrain.summary import build_summary
from ddiloco.protocol import signing, wire
from ddiloco.protocol.messages import ClosingFigures, Done
from ddiloco.run.prepare import prepare
from ddiloco.run.root import RunRoot
from ddiloco.store.url import open_store
from tests._harness import status, tiny_config

SECRET = bytes.fromhex("5a" * 32)
OTHER = bytes.fromhex("a5" * 32)
EVAL = EvalConfig(items_per_task=2, val_batches=1, device="cpu")
SFT = SFTConfig(steps=2, batch_size=4, items_per_kind=8, eval_items=2, device="cpu")


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A signed, prepared tiny run (file store); each test copies what it changes into its own root."""
    url = f"file://{tmp_path_factory.mktemp('root')}/run"
    prepare(open_store(url), tiny_config("run"), secret=SECRET)
    return url


@pytest.fixture
def root(prepared: str, tmp_path) -> RunRoot:
    """A fresh copy of the prepared run, opened with its key, holding a signed final model (= version 0)."""
    src, dst = open_store(prepared), open_store(f"file://{tmp_path}/run")
    for key in src.list(""):
        dst.put(key, src.get(key))
    run = RunRoot.open(dst, SECRET, role="test")
    write_final(run, run.key)
    return run


def write_final(run: RunRoot, key: bytes | None) -> None:
    """A final model of version 0 of every fragment, signed with `key` (None: unsigned)."""
    layout = run.layout()
    model = run.model_at_versions(layout, [0] * layout.num_fragments)
    tensors = {n: p.detach() for n, p in model.named_parameters()}
    RunRoot(run.store, run.run_id, key).write_final_model(tensors, [0] * layout.num_fragments, {})


def test_open_derives_the_run_key_from_the_master_secret(root):
    assert root.key == signing.for_run(SECRET, "run")
    assert RunRoot.open(root.store, None, role="test").key is None


def test_evaluate_and_sft_accept_what_the_run_key_signed(root):
    result = evaluate_checkpoint(root, "final", ecfg=EVAL)
    assert result["model"] == "final" and root.eval_result("final")["val_loss"] == result["val_loss"]
    assert run_sft(root, SFT)["steps"] == SFT.steps


@pytest.mark.parametrize("signer", [OTHER, None], ids=["another-key", "unsigned"])
def test_evaluate_refuses_a_final_model_the_run_key_did_not_sign(root, signer):
    write_final(root, signing.for_run(signer, "run"))
    with pytest.raises(ConfigError, match=f"{keys.FINAL_MODEL} does not verify.*set {signing.ENV_VAR}"):
        evaluate_checkpoint(root, "final", ecfg=EVAL)
    assert root.eval_result("final") is None


@pytest.mark.parametrize("signer", [OTHER, None], ids=["another-key", "unsigned"])
def test_sft_refuses_a_final_model_the_run_key_did_not_sign(root, signer):
    write_final(root, signing.for_run(signer, "run"))
    with pytest.raises(ConfigError, match=f"{keys.FINAL_MODEL} does not verify.*set {signing.ENV_VAR}"):
        run_sft(root, SFT)
    assert not root.store.exists(keys.SFT_MODEL)


def test_sft_signs_the_model_it_writes_with_the_run_key(root):
    run_sft(root, SFT)
    blob = root.store.get(keys.SFT_MODEL)
    payload = wire.unpack(blob, expect={"run_id": "run", "kind": "sft"}, key=root.key)
    assert payload.meta[signing.KEY_ID_FIELD] == signing.key_id(root.key.public)
    with pytest.raises(wire.PayloadError, match="bad_signature"):
        wire.unpack(blob, key=signing.for_run(OTHER, "run"))
    assert evaluate_checkpoint(root, "sft", ecfg=EVAL)["kind"] == "sft"


def test_evaluate_reads_the_validation_split_with_the_run_key(root):
    tokens = root.val().to(torch.int32)
    root.store.put(keys.VAL, wire.pack({"tokens": tokens}, {"run_id": "run", "kind": "val"}))  # unsigned
    with pytest.raises(ConfigError, match=f"{keys.VAL} does not verify.*set {signing.ENV_VAR}"):
        evaluate_checkpoint(root, "final", ecfg=EVAL)


def test_a_root_opened_with_another_key_refuses_the_run(root):
    stranger = RunRoot.open(root.store, OTHER, role="test")
    with pytest.raises(ConfigError, match="signed with another key"):
        evaluate_checkpoint(stranger, "latest", ecfg=EVAL)
    with pytest.raises(ConfigError, match=f"{keys.shard_key(0)} does not verify"):
        stranger.shard(0)


def test_documents_round_trip_under_their_keys(root):
    summary = build_summary(root.store)
    root.write_summary(summary)
    root.write_sft_meta({"steps": 1})
    root.write_eval_result("x", {"val_loss": 1.0})
    assert root.store.get_json(keys.SUMMARY) == summary.to_json() and root.summary() == summary
    assert summary.status == "running" and "posttrain_seconds" not in summary.to_json()
    assert root.store.get_json(keys.SFT_META) == root.sft_meta() == {"steps": 1}
    assert root.store.get_json(keys.eval_key("x")) == root.eval_result("x") == {"val_loss": 1.0}
    assert keys.eval_name(keys.eval_key("x")) == "x" and keys.eval_name(keys.EVAL_CURVE) is None
    assert root.done() is None and not root.is_done() and root.has_final_model()
    done = Done(12.5, 6016.0, "budget", 40, ClosingFigures(1, 0, 2.0, 0.0))
    root.write_signed_document(keys.DONE, done.to_json())
    assert root.done() == done and root.is_done() and list(done.to_json()) == [
        "time", "tokens_merged", "reason", "rounds_merged",
        "closing_rounds", "closing_rounds_merged", "closing_seconds", "closing_tokens_merged",
    ]  # fmt: skip
    written = status(run_id="run", versions=[3, 4], loss=2.5)
    root.write_signed_document(keys.STATUS, written.to_json())
    assert root.status() == written
    with pytest.raises(ConfigError, match="run `ddiloco prepare"):
        RunRoot.read_config(open_store("memory://empty-run-root"))


def test_prepared_at_is_a_finite_number_of_the_data_meta_or_none():
    from ddiloco.run.root import prepared_at_of

    assert prepared_at_of({"prepared_at": 1700000000.5}) == 1700000000.5
    assert prepared_at_of({"prepared_at": 17}) == 17.0
    for bad in (None, {}, {"prepared_at": None}, {"prepared_at": "1700000000"}, {"prepared_at": True},
                {"prepared_at": float("nan")}, {"prepared_at": float("inf")}, ["prepared_at"]):  # fmt: skip
        assert prepared_at_of(bad) is None, bad
