"""Post-training of a run on a user corpus: there is no built-in instruction set for it, so without
`sft.data` the run is evaluated, SFT is skipped with a warning that says what to set, and the run ends well
(it used to end in an error after training had finished). The pipeline's `sft` and `evaluate(sft)` steps
(the component bodies, running the real `ddiloco` subprocesses) skip the same way instead of failing."""

import json
import logging
from pathlib import Path

from ddiloco.components.roles import evaluate, export_sft, sft

from ddiloco import keys
from ddiloco.data.synthetic import make_world, synthetic_documents
from ddiloco.posttrain.stages import posttrain
from ddiloco.run.prepare import prepare
from ddiloco.run.root import RunRoot
from ddiloco.store.url import open_store
from tests._harness import tiny_config, train_in_process


class Artifact:
    """A KFP output artifact as a component body sees it: a path, metadata, log_metric."""

    def __init__(self, path: Path) -> None:
        self.path, self.metadata = str(path), {}

    def log_metric(self, name: str, value: float) -> None:
        self.metadata[name] = value


def test_a_user_corpus_without_sft_data_is_evaluated_and_sft_is_skipped_with_a_warning(tmp_path, caplog):
    corpus = tmp_path / "corpus.jsonl"
    docs = synthetic_documents(make_world(0, 8), 0, 300)
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    url = (tmp_path / "run").as_uri()
    store = open_store(url)
    cfg = tiny_config("user-corpus", f"data.source={corpus}", "diloco.token_budget=4000")
    prepare(store, cfg)
    train_in_process(store, 2)
    with caplog.at_level(logging.WARNING, logger="ddiloco.posttrain"):
        fields = posttrain(RunRoot(store, cfg.run_id), eval_cfg=cfg.eval, sft_cfg=cfg.sft)
    assert fields["final_val_loss"] is not None and fields["sft_val_loss"] is None
    assert any("set sft.data=FILE.jsonl" in r.getMessage() for r in caplog.records)
    assert "sft.data" in RunRoot(store, cfg.run_id).sft_skipped()

    # The pipeline's steps: sft skips, evaluate(sft) skips, export-sft leaves an empty Model (present: false),
    # all exit 0.
    store.delete(keys.SFT_SKIPPED)
    tuned, tuned_metrics = Artifact(tmp_path / "sft-model"), Artifact(tmp_path / "sft-metrics")
    sft(store=url, metrics=tuned_metrics)
    assert store.exists(keys.SFT_SKIPPED) and not store.exists(keys.SFT_MODEL)
    scored = Artifact(tmp_path / "eval-metrics")
    evaluate(store=url, metrics=scored, model="sft")
    assert scored.metadata == {} and not store.exists(keys.eval_key("sft"))
    export_sft(store=url, sft_model=tuned)
    assert tuned.metadata["present"] is False and tuned.metadata["checkpoint"] == "sft"
    assert not Path(tuned.path).exists()
