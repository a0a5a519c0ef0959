"""A learner's I/O threads never lose an exception, heartbeats never wait behind uploads, and a learner none of
whose answers is merged stops once the bound is reached, but never during a store outage or while the syncer
is down. Real learners and a real syncer over a memory store, in one process."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import wait

import pytest

from ddiloco import keys
from ddiloco.codec import registry
from ddiloco.learner.loop import Learner, Opened
from ddiloco.run.prepare import prepare
from ddiloco.store.base import Store
from ddiloco.store.url import open_store
from ddiloco.store.wrapped import DelegatingStore, OutageStore
from ddiloco.syncer.loop import Syncer
from tests._harness import tiny_config

BUG = "injected bug"


def _prepared(name: str, *overrides: str) -> Store:
    store = open_store(f"memory://{name}")
    prepare(store, tiny_config(name, *overrides))
    return store


def _started(store: Store, **kwargs) -> Learner:
    learner = Learner(store, 0, Opened.read(store, 0, None, None), **kwargs)
    learner.start()
    learner._stop.set()  # no poller thread: the test polls
    learner.io_schedule.heartbeat_every_s = learner.io_schedule.next_report = 0.0  # one at every step
    return learner


def _io_errors(learner: Learner, kind: str) -> float | None:
    labels = {"learner_id": "0", "kind": kind}
    return learner.registry.get_sample_value("ddiloco_learner_io_errors_total", labels)


def _bug_logged(caplog: pytest.LogCaptureFixture, kind: str) -> bool:
    """An ERROR record of the kind's thread that carries the bug's traceback."""
    return any(
        r.levelno == logging.ERROR and kind in r.getMessage() and r.exc_info and BUG in str(r.exc_info[1])
        for r in caplog.records
    )


def _raise(*args, **kwargs):
    raise ValueError(BUG)


def _break_uploads(monkeypatch) -> None:
    """Every upload codec's `encode` raises (a codec bug on the learners' upload threads; nothing else encodes)."""
    for name in registry.names("upload"):
        monkeypatch.setattr(registry.get(name), "encode", _raise)


def test_an_upload_thread_raising_a_bug_is_logged_at_error_and_counted(monkeypatch, caplog):
    store = _prepared("health-upload")
    syncer = Syncer.open(store, poll_s=0)
    learner = _started(store)
    _break_uploads(monkeypatch)
    for _ in range(500):
        syncer.step()
        learner.poller.poll_once()
        learner.tick()
        wait(learner.exchange.uploads)
        if learner.exchange.rounds_answered >= 2:
            break
    assert learner.exchange.rounds_answered >= 2
    assert _io_errors(learner, "upload") == learner.exchange.rounds_answered
    assert _bug_logged(caplog, "upload")
    assert learner.ledger.tokens_processed > 0  # it trained on
    learner.close("max_steps")


def test_a_heartbeat_raising_a_bug_is_logged_at_error_and_counted(monkeypatch, caplog):
    store = _prepared("health-heartbeat")
    learner = _started(store)
    put_json = store.put_json

    def put_json_with_a_bug(key: str, obj: object) -> None:
        if key == keys.report_key(0, learner.incarnation):
            raise TypeError(BUG)  # e.g. a value json cannot write
        put_json(key, obj)

    monkeypatch.setattr(store, "put_json", put_json_with_a_bug)
    for _ in range(3):
        learner.tick()
        wait([learner.heartbeats.last])
    assert _io_errors(learner, "heartbeat") == 3
    assert _bug_logged(caplog, "heartbeat")
    monkeypatch.undo()
    learner.close("max_steps")


def test_a_checkpoint_raising_a_bug_is_logged_at_error_and_counted(monkeypatch, caplog):
    store = _prepared("health-ckpt")
    learner = _started(store)
    monkeypatch.setattr("ddiloco.learner.io.write_checkpoint", _raise)  # a packing bug in the checkpoint
    learner.io_schedule.checkpoint_every_s = learner.io_schedule.next_checkpoint = 0.0
    learner.tick()
    learner.pool.shutdown(wait=True)  # every checkpoint write ran
    assert _io_errors(learner, "checkpoint") >= 1
    assert _bug_logged(caplog, "checkpoint")
    assert not store.exists(keys.ckpt_latest_key(0))
    learner.close("max_steps")


def test_a_download_thread_raising_a_bug_is_logged_counted_and_ends_the_learner(monkeypatch, caplog):
    """A learner that cannot take new globals would train on stale parameters: the bug is raised at the
    step boundary that collects the download, after its thread logged and counted it."""
    store = _prepared("health-download")
    syncer = Syncer.open(store, poll_s=0)
    learner = _started(store)
    monkeypatch.setattr("ddiloco.learner.versions.read_global_full", _raise)
    monkeypatch.setattr("ddiloco.learner.versions.read_global_delta", _raise)
    with pytest.raises(ValueError, match=BUG):
        for _ in range(500):
            syncer.step()
            learner.poller.poll_once()
            learner.tick()
            wait(list(learner.feed.downloads.values()))
    assert _io_errors(learner, "download") >= 1
    assert _bug_logged(caplog, "download")
    learner.close("error")


class BlockedUpdates(DelegatingStore):
    """Puts of update objects wait until `gate` is set (an upload of a 1b fragment over a slow link)."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.gate = threading.Event()
        self.blocked = 0
        self._lock = threading.Lock()

    def _put(self, full_key: str, data: bytes) -> None:
        if f"/{keys.UPDATES}" in f"/{full_key}":
            with self._lock:
                self.blocked += 1
            self.gate.wait()
        super()._put(full_key, data)


def test_heartbeats_keep_flowing_while_every_io_thread_is_stuck_in_an_upload():
    store = _prepared("health-starve", "diloco.fragments=4", "diloco.overlap=4")
    blocked = BlockedUpdates(store)
    syncer = Syncer.open(store, poll_s=0)
    learner = _started(blocked)
    report_key = keys.report_key(0, learner.incarnation)
    try:
        for _ in range(2000):  # until the I/O pool's 3 threads all wait on an upload
            syncer.step()
            learner.poller.poll_once()
            learner.tick()
            if blocked.blocked >= 3:
                break
        assert blocked.blocked >= 3, "every I/O thread is stuck in an upload"
        before = store.get_json(report_key)  # every answer's report was written before its upload blocked
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            learner.tick()
            now = store.get_json(report_key)
            if now["seq"] > before["seq"]:
                break
            time.sleep(0.01)
        assert now["seq"] > before["seq"] and now["time"] > before["time"], "heartbeats landed"
        assert blocked.blocked >= 3 and not blocked.gate.is_set()  # ... while the uploads were still stuck
    finally:
        blocked.gate.set()
        learner.close("max_steps")


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _broken_learner(name: str, monkeypatch, store_of=lambda s: s):
    """A learner whose every upload raises (a codec bug), a live syncer, and the learner's clock."""
    store = _prepared(name, "train.max_unmerged_s=300", "diloco.round_timeout_s=0.05")
    syncer = Syncer.open(store, poll_s=0)
    clock = Clock()
    learner = _started(store_of(store), clock=clock)
    _break_uploads(monkeypatch)
    return store, syncer, learner, clock


def _run(syncer: Syncer | None, learner: Learner, clock: Clock, seconds: float) -> None:
    """Passes of the syncer and the learner, 10 s of the learner's clock each. The syncer's clock is real:
    paced by the learner's cadence (10 s a step on the learner's clock) it opens a round about every 20 s
    of real time, and none before the learner reported that cadence, so here a live syncer also publishes
    its status on every pass (as it does on every round at a real pace)."""
    for _ in range(int(seconds / 10)):
        if syncer is not None:
            syncer.step()
            syncer.publish_status()
        learner.poller.poll(0.0)
        clock.t += 10.0
        learner.tick()
        time.sleep(0.001)


def test_a_learner_whose_answers_never_merge_stops_after_the_bound(monkeypatch):
    store, syncer, learner, clock = _broken_learner("health-bound", monkeypatch)
    with pytest.raises(RuntimeError, match="none of its answers was merged") as stopped:
        _run(syncer, learner, clock, 2000)
    assert 300 <= learner.bound.unmerged_s <= 310, "stopped at the bound"
    assert syncer.books.next_round > 0 and syncer.books.rounds_merged == 0  # it opened rounds, merged none
    learner.close("error")
    assert "train.max_unmerged_s" in str(stopped.value)


def test_no_stop_during_a_store_outage_or_while_the_syncer_is_down(monkeypatch):
    wall, learners_store = Clock(), []

    def down(store: Store) -> Store:
        learners_store.append(OutageStore(store, [], clock=wall))
        return learners_store[0]

    store, syncer, learner, clock = _broken_learner("health-outage", monkeypatch, down)
    _run(syncer, learner, clock, 100)  # 100 s of 300 counted while all is up
    counted = learner.bound.unmerged_s
    assert 50 <= counted < 300
    learners_store[0].windows = [(wall.t, wall.t + 1e9)]  # the store goes down for the learner
    _run(syncer, learner, clock, 600)
    assert learner.bound.unmerged_s == counted and learner.poller.errors > 0, "an outage pauses the count"
    learners_store[0].windows = []  # the store is back, the syncer goes down: its status stops changing
    _run(None, learner, clock, 600)
    assert learner.bound.unmerged_s - counted <= 120 + 10, "a silent syncer pauses the count"
    learner.close("max_steps")


def test_ddiloco_learner_exits_4_when_its_answers_never_merge(monkeypatch, caplog):
    """The command a pod runs: the bound ends it with exit code 4 (Argo's retry or `ddiloco run`'s restart
    policy starts a new incarnation), with one ERROR line that says why."""
    from ddiloco.cli.main import main

    store = _prepared("health-cli", "train.max_unmerged_s=1", "diloco.round_timeout_s=0.05")
    syncer, stop = Syncer.open(store, poll_s=0), threading.Event()

    def syncer_passes() -> None:
        while not stop.is_set():
            syncer.step()
            time.sleep(0.005)

    thread = threading.Thread(target=syncer_passes, daemon=True)
    _break_uploads(monkeypatch)
    thread.start()
    try:
        # Steps enough to outlast the 1 s bound (600 took ~1 s once rounds came H steps apart): the bound ends it.
        code = main(
            ["learner", "--store", "memory://health-cli", "--learner-id", "0", "--max-steps", "20000"]
        )
    finally:
        stop.set()
        thread.join()
    assert code == 4
    assert any(r.levelno == logging.ERROR and "none of its answers was merged" in r.getMessage()
               for r in caplog.records)  # fmt: skip
    assert store.get_json(keys.report_key(0, 0))["final"], "its last report says it left"
