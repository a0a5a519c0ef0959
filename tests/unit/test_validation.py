"""The syncer's admission rules one by one (`ddiloco.protocol.validation`): reasons, bounds and robust clipping."""

import pytest
import torch

from ddiloco.codec.blockwise import PACKING
from ddiloco.protocol import validation
from ddiloco.protocol.wire import PayloadError


def raw(**over):
    """An update header as its JSON."""
    m = {
        "learner_id": 1, "incarnation": 0, "fragment_id": 0, "round": 7, "base_version": 2, "c_steps": 4,
        "c_tokens": 512, "c_seconds": 0.2, "inner_step": 40, "codec": "fp32",
    }  # fmt: skip
    return {**m, **over}


def meta(**over):
    """An update header, typed."""
    return validation.header_fields(raw(**over))


def reason(fn, *args, **kwargs) -> str | None:
    try:
        fn(*args, **kwargs)
    except PayloadError as e:
        return e.reason
    return None


@pytest.mark.parametrize(
    "over",
    [{"c_steps": -1}, {"round": True}, {"inner_step": "9"}, {"c_seconds": float("nan")}, {"codec": None}],
)
def test_header_fields_must_have_usable_types(over):
    assert reason(validation.header_fields, raw(**over)) == "malformed"
    assert reason(validation.header_fields, raw()) is None


def test_identity_and_round_must_match_where_the_update_is_filed():
    assert reason(validation.identity, meta(), (1, 0), 7) is None
    assert reason(validation.identity, meta(), (2, 0), 7) == "replay"
    assert reason(validation.identity, meta(), (1, 1), 7) == "replay"
    assert reason(validation.identity, meta(), (1, 0), 9) == "replay"


@pytest.mark.parametrize(
    "over, why",
    [
        ({}, None),
        ({"codec": "int4"}, "bad_codec"),
        ({"c_steps": 0}, "bad_counters"),
        ({"c_tokens": 0}, "bad_counters"),
        ({"c_tokens": 4 * 128 + 1}, "bad_counters"),  # more tokens per step than the batch holds
        ({"base_version": 3}, "bad_base"),
    ],
)
def test_counters(over, why):
    assert (
        reason(validation.counters, meta(**over), codec="fp32", tokens_per_step=128, latest_version=2) == why
    )


@pytest.mark.parametrize("codec", ["int4", "int2"])
def test_int4_and_int2_updates_must_name_this_versions_packing(codec):
    """Codes packed another way (an older learner's interleaved pairs) are in range and decode to wrong
    values without error, so the header's `packing` is checked, not guessed (fails without the check)."""
    check = lambda **over: reason(  # noqa: E731
        validation.counters, meta(codec=codec, **over), codec=codec, tokens_per_step=128, latest_version=2
    )
    assert check(packing=PACKING) is None
    assert check() == "bad_codec"
    assert check(packing="interleaved") == "bad_codec"
    with pytest.raises(PayloadError, match="same ddiloco version"):
        validation.counters(meta(codec=codec), codec=codec, tokens_per_step=128, latest_version=2)


@pytest.mark.parametrize("base, cap, why", [(2, 0, None), (1, 1, None), (0, 1, "too_stale"), (0, None, None)])
def test_staleness_cap(base, cap, why):
    assert reason(validation.staleness, meta(base_version=base), latest_version=2, max_staleness=cap) == why


def test_steps_not_in_the_future_without_history():
    clock = validation.StepClock()
    ok = meta()
    assert reason(clock.check, "1-0", ok, published_at=100.0, now=101.0) is None
    assert (
        reason(clock.check, "1-0", meta(c_steps=41, c_tokens=41), None, 0.0) == "future_steps"
    )  # > inner_step
    assert reason(clock.check, "1-0", meta(c_seconds=1e-6), None, 0.0) == "future_steps"  # 4 steps in 1 µs
    # trained on version 2 for 0.2 s although it was published 0.1 s ago: fine within the slack...
    assert reason(clock.check, "1-0", ok, published_at=100.0, now=100.1) is None
    # ... but not for 30 s
    assert reason(clock.check, "1-0", meta(c_seconds=30.0), published_at=100.0, now=110.0) == "future_steps"


def test_steps_agree_with_the_learners_own_clock():
    clock = validation.StepClock()
    clock.record("1-0", meta(inner_step=40, base_version=2, c_steps=4))
    same_base = dict(round=9, inner_step=46, base_version=2)
    assert reason(clock.check, "1-0", meta(**same_base, c_steps=10), None, 0.0) is None  # 4 + 6 steps
    assert reason(clock.check, "1-0", meta(**same_base, c_steps=11), None, 0.0) == "future_steps"
    newer = dict(round=9, inner_step=46, base_version=3)
    assert reason(clock.check, "1-0", meta(**newer, c_steps=6), None, 0.0) is None
    assert reason(clock.check, "1-0", meta(**newer, c_steps=7), None, 0.0) == "future_steps"
    assert reason(clock.check, "1-0", meta(inner_step=39, c_steps=4), None, 0.0) == "future_steps"
    assert reason(clock.check, "1-0", meta(inner_step=50, base_version=1), None, 0.0) == "future_steps"
    assert reason(clock.check, "2-0", meta(**same_base, c_steps=11), None, 0.0) is None  # others: no history
    assert reason(clock.check, "1-0", meta(fragment_id=1, c_steps=11), None, 0.0) is None  # per fragment


def test_step_clock_history_is_bounded():
    clock = validation.StepClock(capacity=3)
    for i in range(10):
        clock.record(f"{i}-0", meta())
    assert len(clock._last) == 3


def test_clipping_bounds_outliers_to_a_multiple_of_the_median_norm():
    g = [{"a": torch.full((4,), 1.0)}, {"a": torch.full((4,), 1.2)}, {"a": torch.full((4,), 10.0)}]
    out, scaled = validation.clip_outliers(g, 2.0)
    assert set(scaled) == {2}
    median = validation.global_norm(g[1])
    assert validation.global_norm(out[2]) == pytest.approx(2.0 * median)
    assert torch.equal(out[0]["a"], g[0]["a"]) and torch.equal(out[1]["a"], g[1]["a"])
    torch.testing.assert_close(
        out[2]["a"] / out[2]["a"].norm(), g[2]["a"] / g[2]["a"].norm()
    )  # direction kept


def test_two_answers_are_never_clipped_at_factor_two():
    for big in (1.0, 3.0, 1e6):
        _, scaled = validation.clip_outliers([{"a": torch.ones(3)}, {"a": big * torch.ones(3)}], 2.0)
        assert scaled == {}
    _, scaled = validation.clip_outliers([{"a": torch.ones(3)}], 1.0)
    assert scaled == {}


def test_reports_are_checked_before_the_syncer_reads_them():
    good = {"learner_id": 3, "incarnation": 0, "time": 1.0, "started_at": 0.5, "fragments": {}}
    assert validation.report_ok(good, 3)
    assert not validation.report_ok(good, 4)
    assert not validation.report_ok({**good, "time": "now"}, 3)
    assert validation.report_ok({**good, "step_wall_ema": 0.2, "productive_seconds": 3.0}, 3)
    assert not validation.report_ok({**good, "step_wall_ema": "fast"}, 3)
    assert not validation.report_ok({**good, "productive_seconds": [1]}, 3)
    assert not validation.report_ok([], 3)
    assert not validation.report_ok({**good, "fragments": {"0": {"discarded_tokens": None}}}, 3)
