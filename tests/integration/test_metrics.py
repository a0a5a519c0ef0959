"""Metrics read back from the registries after driving real learner and syncer code."""

import urllib.request

import pytest
from prometheus_client import CollectorRegistry

from ddiloco import keys
from ddiloco.learner.loop import Learner
from ddiloco.posttrain.summary import build_summary
from ddiloco.protocol.messages import Status
from ddiloco.run.prepare import prepare
from ddiloco.store.url import open_store
from ddiloco.syncer.loop import Syncer
from ddiloco.tracking.metrics import serve
from tests._harness import drive, tiny_config


def test_registries_agree_with_the_books():
    store = open_store("memory://metrics-books")
    cfg = tiny_config("metrics-books", "train.peak_flops=2e11")  # a CPU has no data-sheet peak: stated here
    prepare(store, cfg)
    syncer = Syncer.open(store, poll_s=0, registry=CollectorRegistry())
    learners = [Learner.open(store, i, registry=CollectorRegistry()) for i in range(2)]
    for learner in learners:
        learner.start()
    drive(syncer, learners)
    syncer.roster.refresh()  # the learners' final reports, as the next pass of the loop would read them
    get = syncer.registry.get_sample_value
    assert get("ddiloco_syncer_tokens_merged_total") == syncer.tokens_merged() >= cfg.diloco.token_budget
    assert get("ddiloco_syncer_rounds_total", {"outcome": "merged"}) == syncer.books.rounds_merged
    assert get("ddiloco_syncer_quorum_size_count") == syncer.books.rounds_merged
    assert get("ddiloco_syncer_quorum_size_sum") == sum(f.ledger.merged_answers for f in syncer.fragments)
    for p, v in enumerate(syncer.versions):
        assert get("ddiloco_syncer_global_version", {"fragment": str(p)}) == v
        assert get("ddiloco_syncer_merges_total", {"fragment": str(p)}) == v
    assert get("ddiloco_syncer_token_budget") == cfg.diloco.token_budget
    assert 0.95 <= get("ddiloco_syncer_goodput") <= 1, "nothing failed: no learner time was lost"
    processed = sum(learner.ledger.tokens_processed for learner in learners)
    assert get("ddiloco_syncer_merged_token_share") == pytest.approx(syncer.tokens_merged() / processed)
    assert get("ddiloco_syncer_published_bytes_total") > 0
    for learner in learners:
        lget, lbl = learner.registry.get_sample_value, {"learner_id": str(learner.learner_id)}
        assert lget("ddiloco_learner_inner_steps_total", lbl) == learner.inner_step
        assert lget("ddiloco_learner_tokens_total", lbl) == learner.ledger.tokens_processed
        assert lget("ddiloco_learner_rounds_answered_total", lbl) == learner.exchange.rounds_answered > 0
        assert lget("ddiloco_learner_uploaded_bytes_total", lbl) == learner.exchange.bytes_up > 0
        fates = lget("ddiloco_learner_merged_tokens_total", lbl) + lget(
            "ddiloco_learner_discarded_tokens_total", lbl
        )
        assert abs(fates - learner.ledger.tokens_processed) < 1e-6, (
            "every processed token is merged or discarded"
        )
        assert lget("ddiloco_learner_incarnation", lbl) == 0
        assert lget("ddiloco_learner_loss", lbl) == learner.loss
        # Issue 52: MFU from the stated peak, processed tokens/s, data wait, peak memory (RSS on CPU).
        eff = learner.efficiency
        assert eff.flops_per_token == learner.model.flops_per_token(cfg.model.seq_len)
        assert (
            lget("ddiloco_learner_mfu", lbl)
            == eff.mfu
            == pytest.approx(eff.flops_per_token * eff.tokens_per_s / 2e11)
        )
        assert 0 < eff.mfu < 1 and lget("ddiloco_learner_tokens_per_second", lbl) == eff.tokens_per_s
        wait = lget("ddiloco_learner_data_wait_seconds_total", lbl)
        assert 0 < wait < lget("ddiloco_learner_step_seconds_total", lbl)
        assert lget("ddiloco_learner_peak_memory_bytes", {**lbl, "kind": "peak_rss"}) > 64 << 20
    status = Status.from_json(store.get_json(keys.STATUS))  # the fleet's, for `ddiloco run`'s progress line
    assert status.mfu is not None and status.tokens_per_s is not None
    summary = build_summary(store)
    assert 0 < summary.mfu < 1 and summary.processed_tokens_per_s > 0
    assert 0 < summary.data_wait_fraction < 1 and summary.peak_memory_kind == "peak_rss"
    for a in summary.learner_accounting.values():
        assert 0 < a["mfu"] < 1 and a["peak_memory_bytes"] > 64 << 20 and a["processed_tokens_per_s"] > 0


def test_metrics_are_served_over_http():
    registry = CollectorRegistry()
    store = open_store("memory://metrics-http")
    prepare(store, tiny_config("metrics-http"))
    syncer = Syncer.open(store, registry=registry)
    port = serve(registry, 0, "127.0.0.1")
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert "ddiloco_syncer_tokens_merged_total 0.0" in body
    assert 'ddiloco_syncer_global_version{fragment="1"} 0.0' in body
    assert syncer.tokens_merged() == 0
