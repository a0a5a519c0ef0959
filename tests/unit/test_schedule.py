"""The inner learning-rate schedule: warm-up, then decay on the run's global progress; `auto` resolved for the
learners by how many outer steps the decay would span."""

import math

import pytest

from ddiloco import keys
from ddiloco.config.recipes import RECIPES, load_config
from ddiloco.config.run import TrainConfig
from ddiloco.errors import ConfigError
from ddiloco.learner.loop import Learner
from ddiloco.posttrain.sft import SFTConfig, sft_lr
from ddiloco.protocol.messages import Status
from ddiloco.run.prepare import prepare
from ddiloco.run.schedule import (
    GlobalSchedule,
    decay_factor,
    inner_lr,
    learner_train,
    lr_at,
    outer_steps_in_decay,
    progress_of,
    resolve,
)
from ddiloco.store.url import open_store
from tests._harness import status, tiny_config


def _t(**kw) -> TrainConfig:
    return TrainConfig(**{"lr": 1.0, "warmup_steps": 4, **kw})


def test_warmup_is_linear_on_the_callers_own_steps():
    t = _t()
    assert [inner_lr(0.0, s, t) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert inner_lr(0.0, 0, _t(warmup_steps=0)) == 1.0
    assert inner_lr(0.5, 1, t) == pytest.approx(0.5 * inner_lr(0.5, 99, t))  # warm-up scales the decayed rate


def test_cosine_decays_from_the_peak_to_the_floor_and_stays_there():
    t = _t(lr=2e-3, lr_schedule="cosine")  # cosine to 0.1 × lr
    assert t.lr_min_ratio == 0.1
    auto = _t(lr=2e-3)  # the default, unresolved (data-parallel): the same cosine
    assert auto.lr_schedule == "auto"
    assert [inner_lr(i / 10, 10, auto) for i in range(11)] == [inner_lr(i / 10, 10, t) for i in range(11)]
    assert inner_lr(0.0, 10, t) == pytest.approx(2e-3)
    assert inner_lr(0.5, 10, t) == pytest.approx(2e-3 * 0.55)  # halfway between peak and floor
    assert inner_lr(0.25, 10, t) == pytest.approx(2e-3 * (0.1 + 0.45 * (1 + math.cos(math.pi / 4))))
    assert inner_lr(1.0, 10, t) == pytest.approx(2e-4)
    for beyond in (1.0001, 1.5, 10.0, math.inf):  # merged past the budget: clamped at the floor
        assert inner_lr(beyond, 10, t) == pytest.approx(2e-4)
    assert inner_lr(-0.3, 10, t) == pytest.approx(2e-3)
    curve = [inner_lr(i / 100, 10, t) for i in range(101)]
    assert all(a >= b for a, b in zip(curve, curve[1:], strict=False))  # monotone non-increasing
    linear_drop = (curve[0] - curve[-1]) / 100  # per 1% of progress
    assert (
        curve[0] - curve[1] < 0.05 * linear_drop and curve[-2] - curve[-1] < 0.05 * linear_drop
    )  # flat ends


def test_linear_and_constant_shapes_and_the_floor_ratio():
    assert decay_factor(0.25, "linear", 0.1) == pytest.approx(0.775)
    assert decay_factor(1.0, "linear", 0.0) == 0.0
    assert decay_factor(2.0, "linear", 0.3) == pytest.approx(0.3)
    assert all(decay_factor(p, "constant", 0.1) == 1.0 for p in (0.0, 0.5, 1.0, 3.0))
    assert decay_factor(1.0, "cosine", 0.0) == pytest.approx(0.0, abs=1e-12)
    assert decay_factor(0.7, "cosine", 1.0) == pytest.approx(1.0)  # ratio 1: no decay
    with pytest.raises(ValueError, match="cosine, linear, wsd or constant"):
        decay_factor(0.5, "step", 0.1)


def test_wsd_holds_the_peak_then_cools_down_as_one_minus_sqrt_to_the_floor():
    assert all(decay_factor(p, "wsd", 0.1, 0.2) == 1.0 for p in (0.0, 0.5, 0.8))
    # a quarter of the cool-down: 1 - sqrt(0.25) = 0.5 of the way from the peak to the floor
    assert decay_factor(0.85, "wsd", 0.1, 0.2) == pytest.approx(0.1 + 0.9 * 0.5)
    assert decay_factor(1.0, "wsd", 0.1, 0.2) == pytest.approx(0.1)
    assert decay_factor(3.0, "wsd", 0.0, 0.5) == pytest.approx(0.0)
    assert decay_factor(0.3, "wsd", 0.1, 1.0) < 1.0  # fraction 1: cools down from the start
    curve = [decay_factor(i / 100, "wsd", 0.1, 0.2) for i in range(101)]
    assert all(a >= b for a, b in zip(curve, curve[1:], strict=False))


def test_the_learners_rate_follows_the_wsd_decay_and_a_bad_fraction_is_refused():
    cfg = load_config(None, None, ["train.lr_schedule=wsd", "train.lr_decay_fraction=0.5"])
    assert inner_lr(0.75, 10**6, cfg.train) == pytest.approx(
        cfg.train.lr * decay_factor(0.75, "wsd", 0.1, 0.5)
    )
    with pytest.raises(ConfigError, match="train.lr_decay_fraction=0.0"):
        load_config(None, None, ["train.lr_decay_fraction=0"])


def test_progress_is_clamped_tokens_over_budget():
    assert progress_of(500, 1000) == 0.5
    assert progress_of(1500, 1000) == 1.0 and progress_of(-5, 1000) == 0.0
    assert progress_of(float("nan"), 1000) == 0.0 and progress_of(5, 0) == 0.0


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_every_recipe_decays_by_default(name):
    cfg = load_config(name)
    assert cfg.train.lr_schedule == "auto" and resolve(cfg) == "cosine"  # at the recipe's own budget
    for t in (cfg.train, learner_train(cfg)):  # data-parallel and the learners
        assert inner_lr(1.0, 10**9, t) == pytest.approx(t.lr_min_ratio * t.lr)
        assert inner_lr(1.0, 10**9, t) < 0.2 * t.lr


def test_auto_decays_only_over_enough_outer_steps_for_the_global_model_to_follow():
    # The small-budget check (docs/results.md §12): 2.5M tokens, M = 4, H = 48 -> ~6.4 rounds per fragment,
    # fewer than the outer momentum's horizon 1/(1 - 0.9) = 10: constant. The 40M tokens of docs/results.md
    # §11: cosine.
    small = load_config(overrides=["diloco.token_budget=2500000", "diloco.sync_every=48"])
    assert outer_steps_in_decay(small) == pytest.approx(2_500_000 / (4 * 16 * 128) / 48)
    assert resolve(small) == "constant" and learner_train(small).lr_schedule == "constant"
    assert small.train.lr_schedule == "auto"  # the config itself is not changed (data-parallel reads it)
    big = load_config(overrides=["diloco.token_budget=40000000"])
    assert resolve(big) == "cosine" and outer_steps_in_decay(big) > 100
    # What the horizon depends on: no outer momentum -> one outer step is enough.
    assert resolve(load_config(overrides=[*_SMALL, "diloco.outer_momentum=0"])) == "cosine"
    # More ranks or learners per step -> fewer learner steps for the same budget -> fewer outer steps.
    assert outer_steps_in_decay(load_config(overrides=["train.ranks=2"])) == pytest.approx(
        outer_steps_in_decay(load_config()) / 2
    )
    # wsd spans its cool-down only; an explicit schedule is never changed.
    wsd = load_config(overrides=["train.lr_schedule=wsd"])
    assert outer_steps_in_decay(wsd, "wsd") == pytest.approx(0.2 * outer_steps_in_decay(wsd))
    for name in ("cosine", "wsd", "linear", "constant"):
        assert resolve(load_config(overrides=[*_SMALL, f"train.lr_schedule={name}"])) == name


_SMALL = ("diloco.token_budget=2500000", "diloco.sync_every=48")


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "train.lr_schedule=step",
            "train.lr_schedule='step': choose one of auto, cosine, linear, wsd, constant",
        ),
        ("train.lr_min_ratio=1.5", "train.lr_min_ratio=1.5 must be in [0, 1]"),
        ("train.lr_min_ratio=-0.1", "train.lr_min_ratio=-0.1 must be in [0, 1]"),
    ],
)
def test_bad_schedule_settings_say_what_to_change(override, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(")):
        load_config(overrides=[override])
    assert (
        load_config(overrides=["train.lr_schedule=constant", "train.lr_min_ratio=0"]).train.lr_min_ratio == 0
    )


def test_global_progress_never_goes_back_and_ignores_bad_statuses():
    s = GlobalSchedule(_t(), 1000)
    assert s.progress == 0.0 and s.observe(None) == 0
    assert s.observe(status(tokens_merged=500.7)) == 500 and s.progress == 0.5
    for stale in (300, math.nan, math.inf):
        assert s.observe(status(tokens_merged=stale)) == 500  # an older or non-finite one never moves it back
    doc = status().to_json()
    for bad in ({k: v for k, v in doc.items() if k != "tokens_merged"}, {**doc, "tokens_merged": "many"},
                {**doc, "tokens_merged": True}):  # fmt: skip
        with pytest.raises(ValueError, match="tokens_merged"):  # never read as a status (`StatusPoller`)
            Status.from_json(bad)
    assert s.observe(status(tokens_merged=2500)) == 2500 and s.progress == 1.0


def test_a_late_joiner_runs_at_the_early_learners_rate_at_the_same_global_progress():
    t, budget = _t(lr=3e-3, warmup_steps=20), 10_000
    early, late = GlobalSchedule(t, budget), GlobalSchedule(t, budget)
    for merged in (0, 1200, 3100, 6000):  # the early learner saw every status
        early.observe(status(tokens_merged=merged))
    late.observe(status(tokens_merged=6000))  # the late one only the current one
    assert early.lr(500) == late.lr(20) == pytest.approx(inner_lr(0.6, 10**6, t))
    assert late.lr(0) == pytest.approx(early.lr(500) / 20)  # its own warm-up first


def _status(cfg, merged: float) -> dict:
    return status(run_id=cfg.run_id, tokens_merged=merged, token_budget=cfg.diloco.token_budget).to_json()


def _tick(learner) -> float:
    learner.poller.poll_once()
    assert learner.tick()
    lrs = {g["lr"] for g in learner.opt.param_groups}
    assert len(lrs) == 1
    return lrs.pop()


def test_learner_optimizer_lr_follows_the_runs_global_progress():
    store = open_store("memory://sched-learner")
    cfg = tiny_config(
        "sched-learner", "train.warmup_steps=2", "diloco.token_budget=100000", "train.lr_schedule=cosine"
    )
    prepare(store, cfg)
    t, budget = cfg.train, cfg.diloco.token_budget
    early = Learner.open(store, 0)
    early.start()
    assert [_tick(early) for _ in range(3)] == pytest.approx(
        [t.lr / 2, t.lr, t.lr]
    )  # no status: warm-up only

    store.put_json(keys.STATUS, _status(cfg, budget / 2))  # the syncer says half the budget is merged
    half = inner_lr(0.5, 99, t)
    assert half == pytest.approx(0.55 * t.lr)
    assert _tick(early) == pytest.approx(half)
    assert early.registry.get_sample_value("ddiloco_learner_learning_rate", {"learner_id": "0"}) == half
    report = early._report().to_json()
    assert report["lr"] == half and report["progress"] == 0.5

    late = Learner.open(store, 1)  # joins now: warms up over its own steps, then matches the early learner
    late.start()
    assert _tick(late) == pytest.approx(half / 2)
    assert _tick(late) == pytest.approx(half) == _tick(early)

    store.put_json(keys.STATUS, _status(cfg, budget * 0.3))  # a stale status never raises the rate again
    assert _tick(early) == pytest.approx(half)
    store.put_json(keys.STATUS, _status(cfg, budget * 1.2))  # past the budget: the floor
    assert _tick(early) == pytest.approx(t.lr_min_ratio * t.lr) == _tick(late)
    for learner in (early, late):
        learner.close("max_steps")


def test_every_schedule_is_lr_at_with_its_own_parameters():
    """One `lr_at` (issue 53): the learners' rate, the warm-up alone and SFT's warm-up + cosine to 10% over its
    own steps are that function with their parameters, equal to their closed forms."""
    t = _t(lr=3e-3, warmup_steps=5, lr_schedule="wsd", lr_decay_fraction=0.3)
    for p in (0.0, 0.4, 0.8, 1.0):
        for s in range(8):
            decay = decay_factor(p, "wsd", t.lr_min_ratio, 0.3)
            assert inner_lr(p, s, t) == t.lr * min(1.0, (s + 1) / 5) * decay
    assert [lr_at(s, 2.0, 4) for s in range(6)] == [2.0 * min(1.0, (s + 1) / 4) for s in range(6)]
    cfg = SFTConfig(steps=60, lr=1e-3, warmup_steps=20)
    for s in range(70):
        if s < 20:  # (lr·(s+1))/W before, lr·((s+1)/W) now: the last bit of a double may differ
            assert sft_lr(s, cfg) == pytest.approx(cfg.lr * (s + 1) / 20, rel=1e-15, abs=0)
        else:
            cosine = 0.1 + 0.45 * (1 + math.cos(math.pi * min((s - 20) / 40, 1.0)))
            assert sft_lr(s, cfg) == cfg.lr * cosine
