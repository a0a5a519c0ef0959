"""The syncer's loop around a publish cut short, in one process over a memory store with real learners: a
store error between two writes (the merge is retried), a crash at any step (a successor with the next epoch
takes over), and a round abandoned after a crash left its record (`ddiloco.syncer.loop`). Every write of a
publish is cut in `tests/unit/test_publish_crash.py`; here the steps where the loop's own handling matters."""

from __future__ import annotations

import pytest

from ddiloco import keys
from ddiloco.learner.io import RoundRecords
from ddiloco.learner.loop import Learner
from ddiloco.platform import failpoints
from ddiloco.posttrain.summary import build_summary
from ddiloco.protocol import wire
from ddiloco.run.globalmodel import latest_version
from ddiloco.run.prepare import prepare
from ddiloco.store.base import StoreError
from ddiloco.store.url import open_store
from ddiloco.syncer.loop import Syncer
from tests._harness import tiny_config

BUDGET = "diloco.token_budget=6000"  # ~10 merges: the failpoints fire at the 2nd or 3rd


@pytest.fixture(autouse=True)
def _disarm():
    yield
    failpoints.disarm()


def start(name: str, *overrides: str):
    store = open_store(f"memory://{name}")
    prepare(store, tiny_config(name, BUDGET, *overrides))
    learners = [Learner.open(store, i) for i in range(2)]
    for learner in learners:
        learner.start()
    return store, learners


def tick(learners) -> None:
    for learner in learners:
        learner.poller.poll_once()
        learner.tick()


def drive(syncer: Syncer, learners, max_iters: int = 20000) -> None:
    """Syncer passes and learner steps until the run is done; store errors are ridden out as
    `run_until_done` does (the pass is tried again)."""
    for _ in range(max_iters):
        try:
            if syncer.step():
                break
        except StoreError:
            pass
        tick(learners)
    else:
        raise AssertionError("the run did not finish")
    for learner in learners:
        learner.poller.poll_once()
        assert learner.tick() is False
        learner.close("done")


def assert_sound(store, crash_versions: list[int] | None = None) -> dict:
    s = build_summary(store)
    assert s.status == "done"
    assert s.global_versions_contiguous and s.ledger_balanced
    assert s.versions_by_multiple_epochs == 0
    records = [store.get_json(k) for k in store.list(keys.ROUNDS)]
    for p in range(s.num_fragments):
        latest = latest_version(store, p)
        assert sorted(r["version"] for r in records if r["fragment_id"] == p) == list(range(1, latest + 1))
        for r in records:
            if r["fragment_id"] == p and store.exists(keys.global_key(p, r["version"])):
                assert wire.unpack(store.get(keys.global_key(p, r["version"]))).meta["round"] == r["round"]
        if crash_versions is not None:
            assert latest > crash_versions[p] + 1, f"fragment {p} froze at v{latest}"
    return s


@pytest.mark.parametrize("step", ["after_momentum", "after_record", "after_global", "after_pointer"])
def test_a_store_error_after_any_write_of_a_publish_retries_that_same_publish(step):
    store, learners = start(f"store-error-{step}")
    syncer = Syncer.open(store, poll_s=0)
    failpoints.arm("publish", step, "store_error", nth=2)
    drive(syncer, learners)
    assert failpoints._armed[("publish", step)][2] >= 2, "the failpoint fired"
    assert_sound(store)


@pytest.mark.parametrize(
    ("step", "overrides"),
    [(s, ()) for s in ("after_global", "after_status", "after_state")]
    + [("after_delta", ("diloco.download_codec=int8",))],
)
def test_a_successor_takes_over_from_a_syncer_crashed_at_any_step_of_a_publish(step, overrides):
    store, learners = start(f"crash-{step}-{len(overrides)}", *overrides)
    first = Syncer.open(store, poll_s=0)
    failpoints.arm("publish", step, "raise", nth=3)
    with pytest.raises(failpoints.FailpointCrash):
        for _ in range(20000):
            assert not first.step(), "the run ended before the failpoint"
            tick(learners)
    failpoints.disarm()
    crashed_at = list(first.versions)
    second = Syncer.open(store, poll_s=0)  # seizes the next epoch: the first is gone
    assert second.lease.epoch == first.lease.epoch + 1
    drive(second, learners)
    assert_sound(store, crashed_at)


def test_an_abandoned_round_loses_the_record_a_dead_publish_left():
    """A publish that died after its round record leaves a record of a merge that never happened; if the
    successor then abandons that round, a learner reading the record would credit tokens the syncer never
    merged and the books would not balance."""
    store, learners = start("abandon-stale")
    first = Syncer.open(store, poll_s=0)
    failpoints.arm("publish", "after_record", "raise", nth=3)
    with pytest.raises(failpoints.FailpointCrash):
        for _ in range(20000):
            first.step()
            tick(learners)
    failpoints.disarm()
    (stale,) = [
        r
        for k in store.list(keys.ROUNDS)
        if (r := store.get_json(k))["version"] > first.versions[r["fragment_id"]]
    ]
    second = Syncer.open(store, poll_s=0)
    for _ in range(20000):  # the successor reopens the round number the dead publish recorded
        second.step()
        if stale["round"] in second.rounds.open:
            break
        tick(learners)
    second.rounds.abandon(second.rounds.open[stale["round"]])
    assert store.get_json_or_none(keys.round_record_key(stale["round"])) is None
    assert RoundRecords(store).read(stale["round"]) is None, "a learner reads: closed without a merge"
    drive(second, learners)
    assert_sound(store)
