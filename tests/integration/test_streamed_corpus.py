"""A run over a pre-tokenized corpus read in place (`ddiloco.data.streamed`): text tokenized by `ddiloco tokenize`
(`ddiloco.data.textcorpus`) into `.npy` parts under a `file://` prefix (the same code reads `s3://`). Prepare copies no shard into the run
root, learners stream their own disjoint ranges, the ledger balances and the loss falls; bad corpora are
refused in one line before anything is written."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ddiloco import keys
from ddiloco.data.loader import tokenize_corpus
from ddiloco.data.synthetic import make_world, synthetic_documents
from ddiloco.data.textcorpus.corpus import tokenize_to_npy
from ddiloco.data.tokenizer import ByteTokenizer
from ddiloco.data.tokens.npy import CorpusError
from ddiloco.errors import ConfigError
from ddiloco.posttrain.summary import build_summary
from ddiloco.run.prepare import prepare
from ddiloco.run.root import RunRoot
from ddiloco.store.url import open_store
from tests._harness import tiny_config, train_in_process

STREAMED = ("data.chunk_tokens=4096", "diloco.token_budget=12000")


def _corpus(path, files: int = 4, docs: int = 1200):
    """The synthetic corpus tokenized by bytes, as uint16 `.npy` parts (as a tokenizing pipeline writes them)."""
    ids = tokenize_corpus(synthetic_documents(make_world(0, 8), 0, docs), ByteTokenizer()).numpy()
    path.mkdir(parents=True, exist_ok=True)
    for i, part in enumerate(np.array_split(ids, files)):
        np.save(path / f"part-{i:02d}.npy", part.astype(np.uint16))
    return path, int(ids.size)


def _tokenized(tmp_path, docs: int = 1200):
    """The same corpus as text (JSONL files) through `ddiloco tokenize`'s library: parts + manifest.json."""
    texts = synthetic_documents(make_world(0, 8), 0, docs)
    (tmp_path / "text").mkdir()
    for i in range(3):
        lines = [json.dumps({"text": t}) + "\n" for t in texts[i::3]]
        (tmp_path / "text" / f"docs-{i}.jsonl").write_text("".join(lines))
    out = open_store((tmp_path / "tokens").as_uri())
    done = tokenize_to_npy(str(tmp_path / "text"), out, "", ByteTokenizer(), shard_tokens=8192)
    return done.url, sum(len(ByteTokenizer().encode(t)) + 1 for t in texts)


def test_learners_stream_disjoint_ranges_of_a_token_corpus_and_the_run_root_holds_no_copy(tmp_path):
    corpus, total = _tokenized(tmp_path)
    store = open_store("memory://streamed")
    stored = corpus.removeprefix("file://") + "/tokenizer.json"  # the tokenizer `ddiloco tokenize` used
    cfg = tiny_config("streamed", f"data.source={corpus}", f"data.tokenizer={stored}", *STREAMED)
    meta = prepare(store, cfg)
    assert meta["streamed"] and sum(meta["shard_tokens"]) + meta["val_tokens"] == total
    assert not store.list("data/shards"), "no shard is copied into the run root"
    doc = store.get_json(keys.CORPUS)
    assert [f["count"] for f in doc["manifest"]["files"]] and all(
        f["digest"] for f in doc["manifest"]["files"]
    )
    slots = [{tuple(c) for c in s} for s in doc["plan"]["slots"]]
    assert all(not (a & b) for i, a in enumerate(slots) for b in slots[i + 1 :]), "slots are disjoint"
    assert not {tuple(c) for c in doc["plan"]["val"]} & set().union(*slots), "validation held out"

    train_in_process(store, 2)
    s = build_summary(store)
    assert s.status == "done" and s.ledger_balanced and s.tokens_outstanding == 0
    root = RunRoot(store, cfg.run_id)
    assert root.val().numel() == meta["val_tokens"]
    data_bytes = sum(n for k, n in store.sizes("data/").items())
    assert data_bytes < 4 * meta["val_tokens"] + (2 << 20)  # the validation split and small documents only
    assert root.training_tokens(0, max_tokens=500).numel() == 500  # what SFT's replay reads


def test_a_bad_token_corpus_is_refused_in_one_line_before_anything_is_written(tmp_path):
    corpus, _ = _corpus(tmp_path / "big-ids", files=2, docs=300)
    np.save(corpus / "part-02.npy", np.full(5000, 300, dtype=np.uint16))  # ids past the byte vocabulary
    store = open_store("memory://streamed-bad")
    with pytest.raises(CorpusError, match=r"part-02.npy holds token id 300 .* vocabulary size"):
        prepare(store, tiny_config("bad", f"data.source={corpus}", "data.tokenizer=byte", *STREAMED))
    (corpus / "part-02.npy").unlink()
    np.save(corpus / "part-03.npy", np.zeros((10, 10), dtype=np.uint16))
    with pytest.raises(CorpusError, match=r"part-03.npy .*1-D"):
        prepare(store, tiny_config("bad", f"data.source={corpus}", "data.tokenizer=byte", *STREAMED))
    (corpus / "part-03.npy").unlink()
    (corpus / "manifest.json").write_text(json.dumps({"tokenizer": {"sha256": "0" * 64, "vocab_size": 300}}))
    with pytest.raises(ConfigError, match="was tokenized with another tokenizer"):
        prepare(store, tiny_config("bad", f"data.source={corpus}", "data.tokenizer=byte", *STREAMED))
    (corpus / "manifest.json").unlink()
    with pytest.raises(ConfigError, match="data.tokenizer=/nowhere/tokenizer.json: .*neither"):
        prepare(store, tiny_config("bad", f"data.source={corpus}", "data.tokenizer=/nowhere/tokenizer.json"))
    with pytest.raises(ConfigError, match="data.tokenizer=bpe"):
        prepare(
            store, tiny_config("bad", f"data.source={corpus}", "data.tokenizer=bpe", "data.vocab_size=400")
        )
    with pytest.raises(ConfigError, match="fewer than one batch"):
        prepare(
            store,
            tiny_config(
                "bad", f"data.source={corpus}", "data.tokenizer=byte", *STREAMED, "train.batch_size=999"
            ),
        )
    assert store.list("") == []


def test_a_mixture_of_two_corpora_is_read_at_its_weights_and_reported(tmp_path):
    corpus, _ = _corpus(tmp_path / "text", files=2)
    code = tmp_path / "code"
    code.mkdir()
    rng = np.random.default_rng(0)
    for i in range(2):  # "code": another distribution of byte ids
        np.save(code / f"part-{i}.npy", rng.integers(32, 127, 30000).astype(np.uint16))
    store = open_store("memory://streamed-mix")
    mix = f"data.sources=[{{source: {corpus}, weight: 0.7, name: text}}, {{source: {code}, weight: 0.3}}]"
    cfg = tiny_config("mix", mix, "data.tokenizer=byte", *STREAMED)
    meta = prepare(store, cfg)
    assert meta["streamed"] and [p["name"] for p in store.get_json(keys.CORPUS)["mixture"]] == [
        "text",
        "code",
    ]
    train_in_process(store, 2)
    s = build_summary(store)
    assert s.status == "done" and s.ledger_balanced
    mixture = s.data_mixture
    assert set(mixture) == {"text", "code"} and abs(mixture["text"]["share"] - 0.7) < 0.15, mixture
    assert all(set(d["sources"]) <= {"text", "code"} for d in s.data_read.values())
    with pytest.raises(ConfigError, match="replaces data.source"):
        tiny_config("mix", mix, f"data.source={corpus}")
