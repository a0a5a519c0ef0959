"""A learner's cadence and productive time (`ddiloco.protocol.chiptime`), and goodput from its incarnations'
reports."""

import dataclasses

import pytest

from ddiloco.protocol.chiptime import MIN_STALL_S, STALL_FACTOR, StepCadence, goodput, learner_chip_time
from tests._harness import learner_report


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_cadence_counts_the_loop_not_just_the_step():
    clock = Clock()
    c = StepCadence(clock)
    for _ in range(50):
        clock.t += 0.3  # 0.1 s computing, 0.2 s of loop overhead (fragments, answers, reports)
        c.step_done(0.1)
    assert c.ema == pytest.approx(0.3)
    assert c.productive_seconds == pytest.approx(0.1 + 49 * 0.3)


def test_a_stall_is_lost_time_and_barely_moves_the_cadence():
    clock = Clock()
    c = StepCadence(clock)
    for _ in range(20):
        clock.t += 0.1
        c.step_done(0.1)
    before = c.productive_seconds
    clock.t += 30.0  # SIGSTOPped for half a minute
    c.step_done(0.1)
    assert c.productive_seconds - before == pytest.approx(max(STALL_FACTOR * 0.1, MIN_STALL_S))
    assert c.ema < 0.2
    before = c.productive_seconds
    clock.t += 0.9  # the host was busy elsewhere for most of a second: slow, not stalled
    c.step_done(0.1)
    assert c.productive_seconds - before == pytest.approx(0.9) and c.ema < 0.2


def test_the_loop_is_productive_from_the_join_to_the_wind_down():
    clock = Clock()
    c = StepCadence(clock)
    c.begin()
    clock.t += 0.5  # the first step, after the learner joined
    c.step_done(0.2)
    assert c.ema is None, "the join is no step end: no cadence sample yet"
    for _ in range(10):
        clock.t += 0.1
        c.step_done(0.05)
    clock.t += 0.3  # the run is done: last uploads, final report
    c.finish()
    assert c.productive_seconds == pytest.approx(0.5 + 1.0 + 0.3)
    assert c.ema == pytest.approx(0.1)


def _report(inc, started, joined, time, productive, final=False, reason=None):
    return learner_report(
        learner_id=0, incarnation=inc, started_at=started, joined_at=joined, time=time,
        productive_seconds=productive, busy_seconds=productive / 2, final=final, exit_reason=reason,
    )  # fmt: skip


def test_a_learner_that_trained_all_along_has_goodput_one_whatever_the_clocks():
    # Its host clock is 40 s ahead of the syncer's `done` time: its own final report ends its books.
    rep = _report(0, 1000.0, 1001.0, 1101.0, 99.5, final=True, reason="done")
    productive, provisioned = learner_chip_time([rep], end=1061.0)
    assert provisioned == pytest.approx(100.0) and productive / provisioned == pytest.approx(0.995)


def test_down_time_between_incarnations_is_lost():
    first = _report(0, 0.0, 1.0, 41.0, 40.0)  # killed after its report at 41 s
    second = _report(1, 55.0, 58.0, 101.0, 43.0, final=True, reason="done")  # restarted, joined at 58 s
    productive, provisioned = learner_chip_time([second, first], end=101.0)
    assert provisioned == pytest.approx(100.0) and productive == pytest.approx(83.0)
    assert goodput([(productive, provisioned), (100.0, 100.0)]) == pytest.approx(183 / 200)


def test_a_learner_that_died_for_good_is_down_until_the_end():
    rep = _report(0, 0.0, 0.0, 50.0, 50.0, final=True, reason="error")
    assert learner_chip_time([rep], end=100.0) == (50.0, 100.0)
    assert goodput([(50.0, 100.0)], missing_seconds=100.0) == pytest.approx(0.25)  # one never reported
    assert goodput([]) is None


def test_reports_without_the_field_fall_back_to_compute_time():
    rep = dataclasses.replace(_report(0, 0.0, 0.0, 10.0, 8.0), productive_seconds=None)
    assert learner_chip_time([rep], end=None) == (4.0, 10.0)
