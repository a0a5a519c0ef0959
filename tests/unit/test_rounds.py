"""A round's life as pure decisions (`ddiloco.syncer.rounds`): quorum, grace, merge, abandon; opening pace."""

import math

import pytest

from ddiloco.config.run import DilocoConfig
from ddiloco.syncer.rounds import (
    DEFAULT_STEP_S,
    GraceRule,
    OpenRule,
    QuorumRule,
    Round,
    Verdict,
    decide,
    ema,
    grace_window,
)

RULE = QuorumRule(quorum=2, timeout_s=10.0)


def round_with(*answered: str, opened_at: float = 0.0, quorum_at: float | None = None, grace_s: float = 0.0):
    rnd = Round(7, 1, opened_at, 1000.0 + opened_at, quorum_at=quorum_at, grace_s=grace_s)
    rnd.answers = dict.fromkeys(answered)  # the decision looks at who answered, never at the deltas
    return rnd


def test_no_quorum_waits_then_is_abandoned_after_the_timeout():
    rnd = round_with("0-0", opened_at=5.0)
    assert decide(rnd, {"0-0", "1-0"}, 5.0 + 10.0, RULE) is Verdict.WAIT
    assert decide(rnd, {"0-0", "1-0"}, 5.0 + 10.001, RULE) is Verdict.ABANDON
    assert decide(round_with(), set(), 100.0, RULE) is Verdict.ABANDON


def test_quorum_is_a_verdict_of_its_own_even_when_everyone_answered():
    """The grace window is fixed when the quorum is reached; the merge comes on a later pass."""
    rnd = round_with("0-0", "1-0")
    assert decide(rnd, {"0-0", "1-0"}, 1.0, RULE) is Verdict.QUORUM
    assert decide(rnd, set(), 11.0, RULE) is Verdict.QUORUM, "a quorum past the timeout still counts"


def test_after_quorum_it_waits_out_the_grace_window():
    rnd = round_with("0-0", "1-0", quorum_at=2.0, grace_s=0.5)
    live = {"0-0", "1-0", "2-0"}
    assert decide(rnd, live, 2.4, RULE) is Verdict.WAIT
    assert decide(rnd, live, 2.5, RULE) is Verdict.MERGE
    assert decide(rnd, live, 1e9, RULE) is Verdict.MERGE, "no timeout once the quorum is in"


def test_after_quorum_it_merges_as_soon_as_every_live_learner_answered():
    rnd = round_with("0-0", "1-0", quorum_at=2.0, grace_s=60.0)
    assert decide(rnd, {"0-0", "1-0"}, 2.0, RULE) is Verdict.MERGE
    assert decide(rnd, {"1-0"}, 2.0, RULE) is Verdict.MERGE, "answers of learners since lost still merge"
    assert decide(rnd, set(), 2.0, RULE) is Verdict.MERGE
    assert decide(rnd, {"0-0", "1-1"}, 2.0, RULE) is Verdict.WAIT, "a new incarnation of learner 1 is live"


def test_decide_does_not_change_the_round():
    rnd = round_with("0-0", "1-0")
    decide(rnd, {"0-0"}, 3.0, RULE)
    assert rnd.quorum_at is None and rnd.grace_s == 0.0


def test_grace_window_is_tau_steps_plus_capped_transport():
    rule = GraceRule(gamma=1.0, cap_s=10.0, overlap=2)
    assert grace_window(rule, 0.010, 0.030, 0.020) == 0.0
    assert grace_window(rule, 0.010, 0.030, 0.020, 0.1) == pytest.approx(2 * 0.010 + 0.1 - 0.030 - 0.020)
    assert grace_window(GraceRule(0.5, 10.0, 2), 0.010, 0.0, 0.0) == pytest.approx(0.5 * 2 * 0.010)
    assert grace_window(GraceRule(1.0, 0.05, 2), 0.010, 0.0, 0.0, 9.0) == pytest.approx(0.02 + 0.05)
    assert grace_window(None, 0.010, 0.0, 0.0) == 0.0


def test_ema_takes_the_first_sample_as_it_is():
    assert ema(0.0, 3.0, 0.2) == 3.0
    assert ema(1.0, 3.0, 0.25) == pytest.approx(1.5)


OPEN = OpenRule(overlap=2, sync_every=32, num_fragments=4, sync_from="publish")  # a round every H/P = 8 steps


def may(now: float, **kw) -> bool:
    args = {"fragment": 0, "open_fragments": [], "last_open": -math.inf, "published_clock": -math.inf}
    return OPEN.may_open(now, **(args | {"measured_step": 0.01} | kw))


def test_rounds_open_every_h_over_p_steps_at_most_tau_in_flight():
    assert may(0.0)
    assert not may(0.079, last_open=0.0), "8 steps of 10 ms have not passed"
    assert may(0.08, last_open=0.0)
    assert not may(1.0, open_fragments=[1, 2]), "τ = 2 rounds already in flight"
    assert not may(1.0, open_fragments=[0]), "never two rounds of one fragment"


def test_a_fragment_waits_h_steps_after_its_newest_version():
    assert not may(10.0 + 0.319, published_clock=10.0)
    assert may(10.0 + 0.32, published_clock=10.0)


def test_by_default_a_fragment_waits_h_steps_after_its_last_round_opened():
    rule = OpenRule.of(DilocoConfig(sync_every=32, overlap=2), num_fragments=4)
    kw = {"fragment": 0, "open_fragments": [], "last_open": -math.inf, "measured_step": 0.01}
    assert rule.sync_from == "open"
    assert not rule.may_open(10.319, published_clock=10.2, opened_clock=10.0, **kw)
    assert rule.may_open(10.32, published_clock=10.2, opened_clock=10.0, **kw), (
        "the version's age is not counted"
    )


def test_no_round_opens_before_a_learner_reported_its_cadence():
    """A round opened on a guessed step in the learners' warm-up merged one step of one learner and closed
    before the others saw it (kept run, docs/results.md §12.7): nothing opens until the cadence is known."""
    for now in (0.0, 100 * DEFAULT_STEP_S, 1e6):
        assert not may(now, last_open=-math.inf, measured_step=None)
    assert may(0.0, last_open=-math.inf, measured_step=DEFAULT_STEP_S)
