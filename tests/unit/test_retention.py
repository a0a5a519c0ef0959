"""Bounded storage (issue 16 item 6): which versions the rules keep (`ddiloco.config.retention`), the syncer's pruning
(`ddiloco.syncer.retention`) over a long simulated run, learner checkpoint retention and cadence."""

from __future__ import annotations

import random

import pytest
import torch

from ddiloco import keys
from ddiloco.config.retention import RetentionConfig, curve_moments, curve_stride, kept_versions
from ddiloco.config.run import RunConfig
from ddiloco.errors import ConfigError
from ddiloco.learner.checkpoint import (
    MAX_CHECKPOINT_S,
    MIN_CHECKPOINT_S,
    checkpoint_every_s,
    load_learner_checkpoint,
    save_learner_checkpoint,
)
from ddiloco.model.gpt import PRESETS, configure_optimizer, count_params, gpt_config, init_model
from ddiloco.posttrain.evaluate import curve_points
from ddiloco.run.root import RunRoot
from ddiloco.store.url import open_store
from ddiloco.syncer.retention import Retention


# --- the rules ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("limit", [2, 5, 8, 12])
def test_curve_moments_stay_bounded_evenly_spaced_and_nested(limit):
    previous: set[int] = {0}
    for merges in range(0, 5000):
        moments = curve_moments(merges, limit)
        stride = curve_stride(merges, limit)
        assert moments[0] == 0 and len(moments) <= limit
        assert merges < 2 * limit or len(moments) >= limit // 2  # never thinner than half of the limit
        assert moments == list(range(0, merges + 1, stride)) and stride & (stride - 1) == 0
        # Every moment kept now was a moment when it happened (n itself) and stayed one since: the syncer
        # only ever drops moments, it never needs one it did not record.
        assert set(moments) - {merges} <= previous
        assert all(n in curve_moments(n, limit) for n in moments)
        previous = set(moments)


def test_kept_versions_are_the_window_the_pinned_and_version_zero():
    assert kept_versions(10, {3, 7}, 4) == {0, 3, 7, 8, 9, 10}
    assert kept_versions(1, set(), 4) == {0, 1}
    assert kept_versions(0, set(), 2) == {0}


def test_defaults_keep_at_most_16_versions_and_null_keeps_all():
    cfg = RunConfig()
    assert cfg.retention is not None and cfg.retention.max_versions() <= 16
    with pytest.raises(ConfigError, match="keep_latest"):
        RunConfig.from_dict({"retention": {"keep_latest": 1}})
    with pytest.raises(ConfigError, match="curve_moments"):
        RunConfig.from_dict({"retention": {"curve_moments": 1}})
    assert RunConfig.from_dict({"retention": None}).retention is None


# --- the syncer's pruning over a long run ------------------------------------------------------------------
def _publish(store, p: int, v: int) -> None:
    store.put(keys.global_key(p, v), b"g" * 10)
    store.put_json(keys.global_latest_key(p), {"version": v, "key": keys.global_key(p, v)})
    if v > 0:
        store.put(keys.momentum_key(p, v), b"m" * 10)


def _stored(store, prefix: str) -> set[int]:
    return {v for k in store.list(prefix) if (v := keys.version_of(k, prefix)) is not None}


def test_pruning_over_3000_merges_keeps_a_bounded_set_that_survives_a_restart():
    """Round-robin merges with abandoned rounds (fragments drift apart) and a syncer restart half-way."""
    P, cfg = 3, RetentionConfig()
    store = open_store("memory://retention-long")
    for p in range(P):
        _publish(store, p, 0)
    ret = Retention(store, cfg, P)
    versions, merges, rng = [0] * P, 0, random.Random(0)
    moments_seen: dict[int, list[int]] = {0: [0] * P}
    for s in range(3300):
        p = s % P
        if rng.random() < 0.1:
            continue  # abandoned: no version this time
        if s == 1700:
            ret = Retention(store, cfg, P)  # the syncer restarts: moments come back from the store
        versions[p] += 1
        merges += 1
        _publish(store, p, versions[p])
        moments_seen[merges] = list(versions)
        ret.after_merge(p, versions, merges)
        globals_p, momentum_p = _stored(store, keys.global_prefix(p)), _stored(store, keys.momentum_prefix(p))
        assert len(globals_p) <= cfg.max_versions() and len(momentum_p) <= cfg.keep_latest
        assert {
            0,
            versions[p],
            versions[p] - 1,
        } <= globals_p  # v0, the latest pointer's target, the one before
        assert max(momentum_p) == versions[p]
        # what `keeps` answers is exactly what is in the store
        assert all(ret.keeps(p, v, versions[p]) == (v in globals_p) for v in range(versions[p] + 1))
    for p in range(P):
        assert len(_stored(store, keys.global_prefix(p))) >= cfg.curve_moments // 2
    # the kept moments are the evenly spaced ones, each a model that existed (one version of every fragment)
    doc = store.get_json(keys.RETENTION)
    moments = {int(n): vs for n, vs in doc["moments"].items()}
    assert sorted(moments) == curve_moments(merges, cfg.curve_moments)
    for n, vs in moments.items():
        assert vs == moments_seen[n]
        assert all(v in _stored(store, keys.global_prefix(p)) for p, v in enumerate(vs))


def test_pruning_never_deletes_a_version_newer_than_the_one_it_was_called_for():
    """The cleaner's thread prunes after version v is committed while the publisher may already be writing
    v + 1 of the same fragment (its global, delta, momentum and master land before its pointer). The listing
    shows them; deleting them left a pointer to a missing global (a CI run of the kill-twice chaos test:
    latest 273, not stored)."""
    store = open_store("memory://retention-newer")
    cfg = RetentionConfig(keep_latest=2, curve_moments=2)
    ret = Retention(store, cfg, 1)
    for v in range(6):
        _publish(store, 0, v)
        store.put(keys.master_key(0, v), b"f" * 10)
    ret.prune(0, 3)  # v4 and v5 were written meanwhile
    assert {4, 5} <= _stored(store, keys.global_prefix(0))
    assert {4, 5} <= _stored(store, keys.momentum_prefix(0))
    assert {4, 5} <= _stored(store, keys.master_prefix(0))
    assert 1 not in _stored(store, keys.global_prefix(0))  # the older ones outside the window still go


def test_pruning_without_retention_deletes_nothing_and_a_store_error_does_not_stop_the_syncer(monkeypatch):
    store = open_store("memory://retention-off")
    ret = Retention(store, None, 1)
    for v in range(40):
        _publish(store, 0, v)
        ret.after_merge(0, [v], v)
    assert _stored(store, keys.global_prefix(0)) == set(range(40)) and ret.keeps(0, 1, 39)

    from ddiloco.store.base import StoreUnavailable

    ret = Retention(store, RetentionConfig(), 1)

    def refuse(*_a, **_k):
        raise StoreUnavailable("outage")

    monkeypatch.setattr(store, "list", refuse)
    ret.after_merge(0, [40], 40)  # logged, deferred to the next merge
    monkeypatch.undo()
    ret.after_merge(0, [40], 40)
    assert len(_stored(store, keys.global_prefix(0))) <= RetentionConfig().max_versions()


def test_the_curve_draws_only_moments_whose_versions_are_all_kept():
    records = []
    for n in range(1, 41):  # 40 round-robin merges over 2 fragments
        records.append(
            {
                "round": n - 1,
                "fragment_id": (n - 1) % 2,
                "version": (n + 1) // 2,
                "opened_at": float(n),
                "merged_at": float(n) + 0.5,
                "contributors": {"0-0": {"c_tokens": 100}},
            }
        )
    everything = curve_points(records, 2, 8)
    assert (
        len(everything) == 8
        and everything[0]["versions"] == [0, 0]
        and everything[-1]["versions"] == [20, 20]
    )
    available = [{0, 8, 17, 18, 19, 20}, {0, 8, 17, 18, 19, 20}]
    pts = curve_points(records, 2, 8, available)
    assert pts[0]["versions"] == [0, 0] and pts[-1]["versions"] == [20, 20]
    assert all(v in available[p] for pt in pts for p, v in enumerate(pt["versions"]))
    assert [8, 8] in [pt["versions"] for pt in pts] and len(pts) >= 4


# --- learner checkpoints -----------------------------------------------------------------------------------
def _model_and_opt():
    model = init_model(gpt_config("tiny", vocab_size=64, block_size=16), 0)
    opt = configure_optimizer(model, 1e-3, 0.0, (0.9, 0.95))
    x = torch.randint(0, 64, (2, 16))
    _, loss = model(x, x)
    loss.backward()
    opt.step()
    return model, opt


def test_a_checkpoint_holds_no_parameters_and_only_the_newest_is_kept():
    store = open_store("memory://retention-ckpt")
    model, opt = _model_and_opt()
    store.put(keys.ckpt_key(0, 3), b"left by a crashed incarnation")
    for step in (10, 20, 30):
        save_learner_checkpoint(RunRoot(store, "r"), 0, step, model, opt, {"run_id": "r", "cursor": {}})
    assert store.list(keys.ckpt_prefix(0)) == [keys.ckpt_latest_key(0), keys.ckpt_key(0, 30)]
    from ddiloco.protocol import wire

    payload = wire.unpack(store.get(keys.ckpt_key(0, 30)))
    assert payload.tensors and all(n.startswith("opt/") for n in payload.tensors)
    fresh, fresh_opt = init_model(gpt_config("tiny", vocab_size=64, block_size=16), 1), None
    fresh_opt = configure_optimizer(fresh, 1e-3, 0.0, (0.9, 0.95))
    before = {n: p.detach().clone() for n, p in fresh.named_parameters()}
    meta = load_learner_checkpoint(RunRoot(store, "r"), 0, fresh, fresh_opt)
    assert meta is not None and meta["inner_step"] == 30
    for (n, p), q in zip(fresh.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(fresh_opt.state[p]["exp_avg"], opt.state[q]["exp_avg"])
        assert torch.equal(p.detach(), before[n])  # parameters untouched: they come from the globals


def test_checkpoint_cadence_scales_with_the_state():
    sizes = {name: count_params(gpt_config(name, vocab_size=50257, block_size=1024)) for name in PRESETS}
    every = {name: checkpoint_every_s(None, n) for name, n in sizes.items()}
    assert every["tiny"] == every["small"] == MIN_CHECKPOINT_S
    assert every["350m"] > every["125m"] >= MIN_CHECKPOINT_S and MAX_CHECKPOINT_S >= every["1b"] > 120
    assert list(every.values()) == sorted(every.values())
    assert checkpoint_every_s(0.0, sizes["1b"]) == 0.0 and checkpoint_every_s(5.0, 10) == 5.0
    # the default's write rate at 1b: AdamW moments only, a few tens of MB/s instead of ~670 MB/s
    assert 8 * sizes["1b"] / every["1b"] <= 40e6


def test_evaluating_a_parameter_less_learner_checkpoint_says_what_to_do_instead():
    from ddiloco.posttrain.evaluate import load_model
    from ddiloco.run.globalmodel import build_model, read_layout
    from ddiloco.run.prepare import prepare
    from tests._harness import tiny_config

    store = open_store("memory://retention-eval-learner")
    prepare(store, tiny_config("retention-eval-learner"))
    layout = read_layout(store)
    model = build_model(layout)
    save_learner_checkpoint(
        RunRoot(store, "retention-eval-learner"),
        0,
        5,
        model,
        configure_optimizer(model, 1e-3, 0.0),
        {"run_id": "retention-eval-learner"},
    )
    with pytest.raises(ValueError, match="hold only AdamW state"):
        load_model(RunRoot(store, "retention-eval-learner"), "learner:0", layout)
