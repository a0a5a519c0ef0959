"""Learners and the syncer driven step by step in one process over a memory store: exact and fast."""

import torch

from ddiloco import wire
from ddiloco.globalmodel import latest_version, read_global, read_layout
from ddiloco.learner import Learner
from ddiloco.prepare import prepare
from ddiloco.store import open_store
from ddiloco.summary import build_summary
from ddiloco.syncer import Syncer
from tests._harness import drive, tiny_config


def _prepared(name: str, *overrides: str):
    store = open_store(f"memory://{name}")
    cfg = tiny_config(name, *overrides)
    prepare(store, cfg)
    return store, cfg


def test_run_reaches_budget_with_balanced_ledger_and_contiguous_versions():
    store, cfg = _prepared("eng-ledger")
    syncer = Syncer(store, poll_s=0)
    learners = [Learner(store, i) for i in range(2)]
    for learner in learners:
        learner.start()
    drive(syncer, learners)
    s = build_summary(store)
    assert s["status"] == "done"
    assert s["tokens_merged"] >= cfg.diloco.token_budget
    assert s["ledger_balanced"], (
        s["tokens_merged_per_fragment"],
        s["tokens_merged_by_learners_per_fragment"],
    )
    assert s["tokens_outstanding"] == 0
    assert s["tokens_processed"] == s["tokens_merged"] + s["tokens_discarded"]
    assert s["global_versions_contiguous"] and min(s["global_versions"]) >= 1
    assert s["rejected_updates"] == {}
    assert 0 < s["goodput"] <= 1
    assert store.exists(wire.FINAL_MODEL) and store.exists(wire.DONE)


def test_merge_moves_globals_towards_learners_and_publishes_each_version_once():
    store, cfg = _prepared("eng-versions", "diloco.token_budget=4000")
    layout = read_layout(store)
    v0 = {p: read_global(store, cfg.run_id, layout, p, 0) for p in range(layout.num_fragments)}
    syncer = Syncer(store, poll_s=0)
    learners = [Learner(store, i) for i in range(2)]
    for learner in learners:
        learner.start()
    drive(syncer, learners)
    for p in range(layout.num_fragments):
        v = latest_version(store, p)
        assert v >= 1
        keys = [k for k in store.list(f"global/{p:03d}/") if k.endswith(".safetensors")]
        assert keys == [wire.global_key(p, i) for i in range(v + 1)]
        latest = read_global(store, cfg.run_id, layout, p, v)
        assert any(not torch.equal(latest[n], v0[p][n]) for n in latest)


def test_new_learner_starts_from_the_current_globals_not_its_init():
    store, cfg = _prepared("eng-join", "diloco.token_budget=1000000")
    syncer = Syncer(store, poll_s=0)
    first = Learner(store, 0)
    first.start()
    for _ in range(3000):
        assert not syncer.step()
        first.poller.poll_once()
        first.tick()
        if min(syncer.versions) >= 2:
            break
    assert min(syncer.versions) >= 2
    layout = read_layout(store)
    late = Learner(store, 7)  # a brand-new id joining mid-run
    late.start()
    for p in range(layout.num_fragments):
        v = latest_version(store, p)
        assert late.frags[p].anchor == v
        for n, t in read_global(store, cfg.run_id, layout, p, v).items():
            torch.testing.assert_close(late.params[n].detach(), t)
    late._finish("max_steps")
    first._finish("max_steps")


def test_learner_waits_for_global_version_zero(tmp_path):
    import pytest

    store = open_store("memory://eng-wait")
    cfg = tiny_config("eng-wait")
    prepare(store, cfg)
    for key in store.list("global/"):
        if "latest" in key:
            store.delete(key)
    learner = Learner(store, 0)
    with pytest.raises(TimeoutError, match="global version 0 never appeared"):
        learner.start(wait_timeout=0.5)
    assert not store.list("updates/")


def test_learner_checkpoint_restores_step_optimizer_and_cursor():
    store, cfg = _prepared("eng-ckpt", "train.checkpoint_every_s=0")
    a = Learner(store, 0)
    a.start()
    for _ in range(3):
        a.tick()
    a.pool.shutdown(wait=True)
    step, cursor = a.inner_step, a.loader.state_dict()
    b = Learner(store, 0)
    assert b.incarnation == a.incarnation + 1
    b.start()
    assert b.inner_step == step
    assert b.loader.state_dict() == cursor
    p = next(iter(b.params.values()))
    assert b.opt.state[p]["exp_avg"].abs().sum() > 0
    b._finish("max_steps")
