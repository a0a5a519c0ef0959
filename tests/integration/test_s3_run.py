"""The same end-to-end run with the store on a real S3 server (SeaweedFS on loopback), its corpus too: the
text tokenized into `.npy` parts in the bucket, read in place by the learners with range GETs
(`ddiloco.data.streamed`), one learner SIGKILLed mid-run and resuming its data after its last report."""

import pytest

from ddiloco.data.synthetic import make_world, synthetic_documents
from ddiloco.data.textcorpus.corpus import tokenize_to_npy
from ddiloco.data.tokenizer import ByteTokenizer
from ddiloco.launch import LocalRun
from ddiloco.store.url import open_store
from tests._harness import tiny_config

pytestmark = [pytest.mark.s3, pytest.mark.slow]

KILL = "chaos.events=[{kind: kill_learner, learner: 1, at_step: 25}]"


def test_local_run_over_s3_streaming_its_corpus_from_the_bucket(s3_server, tmp_path, monkeypatch):
    text = tmp_path / "text"
    text.mkdir()
    (text / "docs.txt").write_text("\n".join(synthetic_documents(make_world(0, 8), 0, 1500)))
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)  # prepare runs in this process and reads the corpus from the bucket
    corpus = tokenize_to_npy(
        str(text), open_store(s3_server.url("corpora")), "", ByteTokenizer(), shard_tokens=20000
    )
    cfg = tiny_config(
        "s3e2e", f"data.source={corpus.url}", "data.tokenizer=byte", "data.chunk_tokens=4096",
        "diloco.token_budget=24000", KILL,
    )  # fmt: skip
    run = LocalRun(cfg, tmp_path, store_root=s3_server.url("runs"), extra_env=s3_server.env())
    s = run.run(timeout=600)
    assert run.url.startswith("s3://") and corpus.url.startswith("s3://")
    assert s.status == "done" and s.ledger_balanced and s.global_versions_contiguous
    assert s.final_val_loss < s.initial_val_loss
    assert [e["action"] for e in s.chaos_events] == ["SIGKILL (self)"] and s.tokens_read_twice == 0
    store = open_store(run.url, env=s3_server.env())
    assert store.get_json("summary.json")["run_id"] == "s3e2e"
    assert store.exists("final/model.safetensors") and store.exists("done.json")
    assert store.exists("data/corpus.json") and not store.list("data/shards"), "the corpus is read in place"
    assert not list((tmp_path).glob("s3e2e/*")), "nothing of the run lands on local disk but logs"
