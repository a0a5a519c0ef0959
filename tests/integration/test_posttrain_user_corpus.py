"""Post-training of a run on a user corpus: there is no built-in instruction set for it, so without
`sft.data` the run is evaluated, SFT is skipped with a warning that says what to set, and the run ends well
(it used to end in an error after training had finished)."""

import json
import logging

from ddiloco.posttrain.stages import posttrain
from ddiloco.prepare import prepare
from ddiloco.run import RunRoot
from ddiloco.store.url import open_store
from ddiloco.synthetic import make_world, synthetic_documents
from tests._harness import tiny_config, train_in_process


def test_a_user_corpus_without_sft_data_is_evaluated_and_sft_is_skipped_with_a_warning(tmp_path, caplog):
    corpus = tmp_path / "corpus.jsonl"
    docs = synthetic_documents(make_world(0, 8), 0, 300)
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    store = open_store("memory://user-corpus")
    cfg = tiny_config("user-corpus", f"data.source={corpus}", "diloco.token_budget=4000")
    prepare(store, cfg)
    train_in_process(store, 2)
    with caplog.at_level(logging.WARNING, logger="ddiloco.posttrain.stages"):
        fields = posttrain(RunRoot(store, cfg.run_id), eval_cfg=cfg.eval, sft_cfg=cfg.sft)
    assert fields["final_val_loss"] is not None and fields["sft_val_loss"] is None
    assert any("set sft.data=FILE.jsonl" in r.getMessage() for r in caplog.records)
