"""`ddiloco.syncer.pace`: the overlap and sync-period figures, the lag, and the warning with the threads a
syncer that cannot keep up would need; `OpenRule` counting H from a fragment's last opening."""

import logging
import math

from ddiloco.syncer.pace import Pace
from ddiloco.syncer.rounds import OpenRule


def test_figures_are_means_in_learner_steps_and_the_lag_is_the_period_over_h():
    pace = Pace(since=0.0)
    pace.add(2.0, None, 1.0)  # a fragment's first version: no period yet
    pace.add(4.0, 30.0, 1.0)
    pace.add(3.0, 34.0, 2.0)
    f = pace.figures(sync_every=24, overlap=2, threads=2, now=10.0)
    assert f["rounds_measured"] == 3 and f["mean_overlap_steps"] == 3.0 and f["max_overlap_steps"] == 4.0
    assert f["mean_sync_period_steps"] == 32.0
    assert math.isclose(f["syncer_lag"], 32 / 24 - 1)
    assert f["busy_share"] == 0.4  # 4 s of 10: behind, but not because the syncer is busy
    assert f["syncer_threads_needed"] is None


def test_a_busy_syncer_that_falls_behind_warns_once_a_minute_with_the_threads_it_needs(caplog):
    pace = Pace(since=0.0)
    for _ in range(4):
        pace.add(6.0, 48.0, 2.4)  # H = 24: synced every 48 steps, busy 9.6 s of 10
    f = pace.figures(sync_every=24, overlap=2, threads=2, now=10.0)
    assert f["syncer_lag"] == 1.0 and f["syncer_threads_needed"] == 4
    with caplog.at_level(logging.WARNING, logger="ddiloco.syncer.pace"):
        pace.warn_if_behind(24, 2, 2, now=10.0)
        pace.warn_if_behind(24, 2, 2, now=30.0)  # within the minute: not again
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "about 4 threads/CPUs (now 2)" in warnings[0] and "H = 24" in warnings[0]


def test_a_syncer_that_keeps_up_reports_no_lag_and_asks_for_nothing():
    pace = Pace(since=0.0)
    pace.add(1.0, 23.5, 0.5)
    f = pace.figures(sync_every=24, overlap=2, threads=1, now=100.0)
    assert f["syncer_lag"] == 0.0 and f["syncer_threads_needed"] is None
    assert Pace(since=0.0).figures(24, 2, 1, now=1.0)["syncer_lag"] is None  # nothing measured yet


def test_a_restarted_syncer_continues_the_aggregates_and_ignores_what_it_cannot_read():
    pace = Pace(since=0.0)
    pace.add(3.0, 30.0, 1.0)
    doc = pace.to_json(pace.figures(24, 2, 1, now=5.0))
    again = Pace.from_json(doc, since=50.0)
    assert (again.rounds, again.periods, again.period_steps_sum) == (1, 1, 30.0)
    assert again.busy_seconds == 0.0 and again.since == 50.0  # busy share is this process's
    junk = Pace.from_json({"rounds": -3, "overlap_steps_sum": float("nan"), "periods": True}, since=1.0)
    assert (junk.rounds, junk.overlap_steps_sum, junk.periods) == (0, 0.0, 0)
    assert Pace.from_json(["not", "a", "dict"], since=1.0).rounds == 0


def test_sync_from_open_counts_h_steps_from_the_fragments_last_opening_not_its_last_version():
    kw = dict(fragment=0, open_fragments=[], last_open=-math.inf, measured_step=1.0)
    publish, opened = OpenRule(2, 4, 4, "publish"), OpenRule(2, 4, 4, "open")
    # fragment 0 opened at t = 0, its version was published at t = 3; now t = 4
    assert not publish.may_open(4.0, published_clock=3.0, opened_clock=0.0, **kw)  # H after the version: 7
    assert opened.may_open(4.0, published_clock=3.0, opened_clock=0.0, **kw)
    assert not opened.may_open(3.5, published_clock=3.0, opened_clock=0.0, **kw)
