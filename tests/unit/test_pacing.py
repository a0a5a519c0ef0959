"""Rounds are paced by the learners' real cadence, and the goodput gauge is the paper's (issue 17, items 3
and 7), with the syncer's clocks under the test's control."""

import pytest

from ddiloco import keys
from ddiloco.run.prepare import prepare
from ddiloco.store.url import open_store
from ddiloco.syncer.loop import Syncer
from tests._harness import tiny_config


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def report(lid: int, seq: int, t: float, *, inc: int = 0, started: float = 0.0, **extra) -> dict:
    return {
        "learner_id": lid, "incarnation": inc, "seq": seq, "time": t, "started_at": started,
        "joined_at": started,
        "step_time_ema": 0.01, "step_wall_ema": 0.05, "productive_seconds": 0.0, "tokens_processed": 0,
        "loss_ema": 2.0, "fragments": {}, "final": False, **extra,
    }  # fmt: skip


@pytest.fixture
def setup(request):
    store = open_store(f"memory://pacing-{request.node.name}")
    prepare(store, tiny_config("pacing", "diloco.sync_every=32", "diloco.fragments=2", "diloco.overlap=2"))
    mono, wall = Clock(50.0), Clock(1_000_000.0)
    return store, Syncer.open(store, clock=mono, wall=wall), mono, wall


def test_rounds_open_every_h_over_p_real_steps_not_compute_steps(setup):
    """Learners compute a step in 10 ms but take 50 ms per step with their loop's overhead: a round opens
    every (H/P) · 50 ms = 0.8 s, not every 0.16 s."""
    store, syncer, mono, wall = setup
    for lid in (0, 1):
        store.put_json(keys.report_key(lid, 0), report(lid, 1, wall()))
    syncer.roster.refresh()
    assert syncer.xi_step() == pytest.approx(0.05)
    syncer.rounds.maybe_open(mono())
    assert list(syncer.rounds.open) == [0]
    mono.t += 0.5
    syncer.rounds.maybe_open(mono())
    assert list(syncer.rounds.open) == [0], (
        "a second round 0.5 s (10 real steps) later: faster than H/P = 16 steps"
    )
    mono.t += 0.31
    syncer.rounds.maybe_open(mono())
    assert list(syncer.rounds.open) == [0, 1]


def test_a_fragment_is_not_synced_again_before_h_steps_from_its_last_round(setup):
    store, syncer, mono, wall = setup
    store.put_json(keys.report_key(0, 0), report(0, 1, wall()))
    syncer.roster.refresh()
    syncer.rounds.opened_clock[0] = mono()  # fragment 0's last round opened now (diloco.sync_from: open)...
    syncer.fragments[0].merged_clock = mono() + 0.3  # ...and its version was published 0.3 s later
    syncer.books.next_round = 2  # fragment 0 is next
    mono.t += 32 * 0.05 - 0.1
    syncer.rounds.maybe_open(mono())
    assert not syncer.rounds.open
    mono.t += 0.2  # H steps since the opening, not yet since the version
    syncer.rounds.maybe_open(mono())
    assert [r.fragment_id for r in syncer.rounds.open.values()] == [0]


def test_goodput_gauge_counts_a_dead_learners_down_time_on_the_syncers_clock(setup):
    store, syncer, mono, wall = setup
    t0 = wall() - 30.0  # the learners' hosts' clocks run 30 s behind the syncer's: never compared with it

    def tick(seconds: float) -> None:
        mono.t += seconds
        wall.t += seconds

    for seq in (1, 2):
        tick(10.0)
        for lid in (0, 1):
            rep = report(lid, seq, t0 + 10 * seq, started=t0, productive_seconds=10.0 * seq)
            store.put_json(keys.report_key(lid, 0), rep)
        syncer.roster.refresh()
    assert syncer.metrics_state()["goodput"] == pytest.approx(1.0)
    tick(10.0)  # learner 1 dies: its report stops changing; learner 0 goes on
    store.put_json(keys.report_key(0, 0), report(0, 3, t0 + 30, started=t0, productive_seconds=30.0))
    syncer.roster.refresh()
    assert [r.learner_id for r in syncer.roster.live()] == [0]
    assert syncer.metrics_state()["goodput"] == pytest.approx((30 + 20) / (30 + 30))
    # It restarts: the old incarnation's books stay counted, the gap between them is lost.
    tick(2.0)
    rep = report(1, 1, t0 + 32, inc=1, started=t0 + 31, productive_seconds=0.5)
    store.put_json(keys.report_key(1, 1), rep)
    store.put_json(keys.report_key(0, 0), report(0, 4, t0 + 32, started=t0, productive_seconds=32.0))
    syncer.roster.refresh()
    assert syncer.registry.get_sample_value("ddiloco_syncer_goodput") == pytest.approx((32 + 20.5) / 64)


def test_merged_token_share_gauge(setup):
    store, syncer, mono, wall = setup
    store.put_json(keys.report_key(0, 0), report(0, 1, wall(), tokens_processed=4000))
    store.put_json(keys.report_key(0, 1), report(0, 1, wall(), inc=1, tokens_processed=6000))
    syncer.roster.refresh()
    syncer.fragments[0].ledger.merged_tokens = syncer.fragments[1].ledger.merged_tokens = 8000
    assert syncer.registry.get_sample_value("ddiloco_syncer_merged_token_share") == pytest.approx(0.8)
