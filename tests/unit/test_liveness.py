"""Liveness is judged on the syncer's own clock (issue 17, item 1): learners whose hosts' clocks run 30 s
behind or ahead are live while their reports keep changing, and dead when they stop changing."""

import pytest

from ddiloco import keys
from ddiloco.run.prepare import prepare
from ddiloco.store.url import open_store
from ddiloco.syncer.loop import Syncer
from tests._harness import tiny_config


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def report(lid: int, seq: int, host_time: float) -> dict:
    return {
        "learner_id": lid, "incarnation": 0, "seq": seq, "time": host_time, "started_at": host_time - 5,
        "step_time_ema": 0.01, "loss_ema": 2.0, "fragments": {}, "final": False,
    }  # fmt: skip


@pytest.fixture
def setup():
    store = open_store("memory://liveness")
    prepare(store, tiny_config("liveness", "diloco.learners=2"))
    mono, wall = Clock(50.0), Clock(1_000_000.0)
    return store, Syncer.open(store, clock=mono, wall=wall), mono, wall


@pytest.mark.parametrize("offset_s", [-30.0, 30.0])
def test_learners_with_skewed_clocks_are_live_while_their_reports_change(setup, offset_s):
    store, syncer, mono, wall = setup
    timeout = max(3.0, 5 * syncer.cfg.train.heartbeat_every_s)
    for seq in range(1, 4):
        for lid in (0, 1):
            store.put_json(keys.report_key(lid, 0), report(lid, seq, wall() + offset_s))
        syncer.roster.refresh()
        assert sorted(r.learner_id for r in syncer.roster.live()) == [0, 1], (offset_s, seq)
        mono.t += timeout / 2
        wall.t += timeout / 2
    # rounds open for them: nothing waits on a clock read on another machine
    syncer.rounds.maybe_open(mono())
    assert syncer.rounds.open, "a round opens for live learners with skewed clocks"


def test_a_learner_whose_report_stops_changing_is_dead_after_the_timeout(setup):
    store, syncer, mono, wall = setup
    timeout = max(3.0, 5 * syncer.cfg.train.heartbeat_every_s)
    store.put_json(keys.report_key(0, 0), report(0, 1, wall()))
    store.put_json(keys.report_key(1, 0), report(1, 1, wall()))
    syncer.roster.refresh()
    mono.t += timeout - 0.5
    store.put_json(keys.report_key(1, 0), report(1, 2, wall() + timeout))  # learner 1 heartbeats, 0 does not
    syncer.roster.refresh()
    mono.t += 1.0
    syncer.roster.refresh()
    assert [r.learner_id for r in syncer.roster.live()] == [1]
    # a final report is never live, however fresh
    store.put_json(keys.report_key(1, 0), {**report(1, 3, wall()), "final": True})
    syncer.roster.refresh()
    assert syncer.roster.live() == []
