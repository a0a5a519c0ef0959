"""Issue 17 item 10: learners added mid-run read data of their own, and the summary says who read what.

Runs prepared in-process on a memory store (tiny config); the learners' tokens are checked against the
training stream rebuilt from the corpus, not just against shard ids.
"""

from __future__ import annotations

import logging

import pytest
import torch

from ddiloco import keys
from ddiloco.data.loader import tokenize_corpus
from ddiloco.learner.loop import Learner
from ddiloco.posttrain.summary import build_summary
from ddiloco.run.prepare import corpus_texts, prepare
from ddiloco.run.root import RunRoot
from ddiloco.store.url import open_store
from ddiloco.syncer.loop import Syncer
from tests._harness import drive, tiny_config

ADD_2 = "chaos.events=[{kind: add_learner, learner: 2, at_s: 3600}]"  # fires after these runs end


def _prepared(name: str, *overrides: str):
    store = open_store(f"memory://{name}")
    cfg = tiny_config(name, *overrides)
    meta = prepare(store, cfg)
    return store, cfg, meta


def _training_stream(store, cfg, meta) -> torch.Tensor:
    """The corpus tokenized again, validation split cut off: what the shards must partition."""
    tokens = tokenize_corpus(corpus_texts(cfg)[0], RunRoot(store, cfg.run_id).tokenizer())
    return tokens[: tokens.numel() - meta["val_tokens"]]


def _open(store, ids):
    learners = [Learner.open(store, i) for i in ids]
    for learner in learners:
        learner.pool.shutdown()  # only the start-up reads are under test here
    return learners


@pytest.mark.parametrize("how", ["diloco.max_learners=3", ADD_2], ids=["max_learners", "chaos_add_learner"])
def test_a_third_learner_of_a_two_learner_run_reads_tokens_no_other_learner_reads(how):
    """Fails on main: learner 2 read shard 2 mod 2 = learner 0's tokens (and max_learners did not exist)."""
    store, cfg, meta = _prepared(
        "shards-third-" + ("max" if "max_learners" in how else "add"), how
    )  # diloco.learners=2 in the tiny config
    train = _training_stream(store, cfg, meta)
    tokens = [learner.loader.tokens for learner in _open(store, range(3))]
    assert not torch.equal(tokens[2], tokens[0]), "learner 2 reads learner 0's tokens"
    # Disjoint and covering, by content: the three learners' tokens, in id order, are the training stream.
    assert torch.equal(torch.cat(tokens).to(train.dtype), train)
    assert cfg.diloco.learners == 2 and meta["num_shards"] == 3
    assert all(t.numel() >= cfg.train.batch_size * (cfg.model.seq_len + 1) for t in tokens)


def test_the_summary_names_each_learners_shard_and_token_range():
    store, cfg, meta = _prepared("shards-summary", "diloco.max_learners=3", "diloco.token_budget=6000")
    train = _training_stream(store, cfg, meta)
    syncer = Syncer.open(store, poll_s=0)
    learners = [Learner.open(store, i) for i in range(3)]
    for learner in learners:
        learner.start()
    drive(syncer, learners)
    s = build_summary(store)
    assert s.data_shards == 3 and s.shared_shards == {} and s.unread_shards == []
    assert sorted(s.data_read) == ["0", "1", "2"]
    end = 0
    for lid, learner in enumerate(learners):
        d = s.data_read[str(lid)]
        assert d["shard"] == lid and d["own"] is True and d["start"] == end
        end = d["end"]
        assert torch.equal(learner.loader.tokens.to(train.dtype), train[d["start"] : d["end"]])
        assert d["tokens_processed"] == s.tokens_per_learner[str(lid)] > 0
        # epochs: what the cursor read, about the tokens processed over the shard's length
        assert d["epochs"] == pytest.approx(d["tokens_processed"] / (d["end"] - d["start"]), rel=0.2)
    assert end == train.numel()
    report = store.get_json(keys.report_key(2, learners[2].incarnation))
    summary_keys = ("shard", "start", "end", "own", "epochs")
    assert {k: report["data"][k] for k in summary_keys} == {k: s.data_read["2"][k] for k in summary_keys}
    assert report["data"]["started"] == 0.0 and report["data"]["sources"] is None  # first incarnation, no mix


def test_an_id_beyond_max_learners_shares_a_shard_with_a_warning_and_the_summary_says_so(caplog):
    store, cfg, meta = _prepared("shards-beyond", "diloco.max_learners=3", "diloco.token_budget=6000")
    syncer = Syncer.open(store, poll_s=0)
    with caplog.at_level(logging.WARNING, logger="ddiloco.data.shards"):
        learners = [Learner.open(store, i) for i in (0, 2, 5)]
    warned = [r.getMessage() for r in caplog.records if r.name == "ddiloco.data.shards"]
    assert len(warned) == 1 and "learner 5 has no shard of its own" in warned[0]
    assert "diloco.max_learners" in warned[0] and "shard 2" in warned[0]
    assert torch.equal(learners[2].loader.tokens, learners[1].loader.tokens)  # the documented fallback
    for learner in learners:
        learner.start()
    drive(syncer, learners)
    s = build_summary(store)
    assert s.shared_shards == {"2": [2, 5]}
    assert s.data_read["5"]["shard"] == 2 and s.data_read["5"]["own"] is False
    assert s.data_read["2"]["own"] is True and s.unread_shards == [1]


def test_prepare_says_which_setting_cut_the_shards_too_small():
    from ddiloco.errors import ConfigError

    with pytest.raises(ConfigError, match=r"diloco.max_learners: 400\).*smaller diloco.max_learners"):
        _prepared("shards-small", "diloco.max_learners=400")
