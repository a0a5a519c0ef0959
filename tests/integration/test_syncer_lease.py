"""Two syncers on one run, in one process over a memory store: the holder's renewals are delayed by a store
wrapper, the standby takes the lease over, the old holder stops publishing and exits with FENCED_EXIT; and
the write-once creates under the lease."""

from __future__ import annotations

import argparse
import dataclasses
import threading
import time

import pytest

from ddiloco import keys
from ddiloco.cli.roles import run_syncer
from ddiloco.learner.loop import Learner
from ddiloco.posttrain.summary import build_summary, read_round_records
from ddiloco.protocol import wire
from ddiloco.run.globalmodel import read_layout
from ddiloco.run.prepare import prepare
from ddiloco.run.root import RunRoot
from ddiloco.store.url import open_store
from ddiloco.store.wrapped import DelegatingStore
from ddiloco.syncer.lease import FENCED_EXIT, Fenced, Lease
from ddiloco.syncer.loop import Syncer
from ddiloco.syncer.state import SyncerFiles
from tests._harness import tiny_config

LEASE = ("lease.min_s=0.6", "lease.renew_every_s=0.1")


class SlowRenewals(DelegatingStore):
    """Holds every write of a lease renewal for `delay` seconds (a holder whose store went slow)."""

    delay = 0.0

    def before(self, op: str, key: str) -> None:
        if self.delay and op == "put" and key.startswith(f"{keys.LEASE}renewals/"):
            time.sleep(self.delay)


def wait_for(what, cond, learners, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"no {what} after {timeout}s"
        for learner in learners:
            learner.poller.poll_once()
            learner.tick()


def test_a_syncer_whose_lease_was_taken_over_stops_publishing_and_exits_fenced():
    store = open_store("memory://lease-takeover")
    cfg = tiny_config("lease-takeover", *LEASE, "diloco.token_budget=40000")
    prepare(store, cfg)
    slow = SlowRenewals(store)
    args = argparse.Namespace(store=store.url, metrics_port=None, metrics_host="", max_seconds=120)
    codes: dict[str, int] = {}

    def syncer(name: str, s) -> threading.Thread:
        t = threading.Thread(
            target=lambda: codes.setdefault(
                name, run_syncer(s, Lease(s, "lease-takeover", cfg.lease), args, None)
            )
        )
        t.start()
        return t

    a = syncer("a", slow)
    learners = [Learner.open(store, i) for i in range(2)]
    for learner in learners:
        learner.start()

    def status():
        return store.get_json_or_none(keys.STATUS) or {}

    wait_for(
        "merges by epoch 1", lambda: status().get("epoch") == 1 and status()["rounds_merged"] >= 3, learners
    )
    b = syncer("b", store)
    wait_for("a standby in the status", lambda: status().get("standbys"), learners)
    assert status()["epoch"] == 1
    slow.delay = 3.0  # the holder's renewals stall for longer than its 0.6 s lease
    wait_for("epoch 2", lambda: store.exists(keys.lease_claim_key(2)), learners)
    taken_at = store.get_json(keys.lease_claim_key(2))["time"]
    wait_for("the run's end", lambda: store.exists(keys.DONE), learners, timeout=120)
    for learner in learners:
        learner.poller.poll_once()
        learner.tick()
        learner.close("done")
    a.join(timeout=30)
    b.join(timeout=30)
    assert codes == {"a": FENCED_EXIT, "b": 0}

    records = read_round_records(store)
    by_a = [r for r in records if r["epoch"] == 1]
    assert by_a and [r for r in records if r["epoch"] == 2], "both published, one after the other"
    assert max(r["merged_at"] for r in by_a) < taken_at, "epoch 1 published nothing after the takeover"
    s = build_summary(store)
    assert s.versions_by_multiple_epochs == 0 and s.syncer_epochs == [1, 2]
    assert s.global_versions_contiguous and s.ledger_balanced
    assert store.get_json(keys.SYNCER_STATE)["epoch"] == 2
    # Control: a second record of a published version (what two unfenced syncers leave) is counted.
    store.put_json(keys.round_record_key(10**6), by_a[0] | {"round": 10**6, "epoch": 9})
    s = build_summary(store)
    assert s.versions_by_multiple_epochs == 1 and s.versions_by_epoch["9"] == 1


def test_each_version_is_written_once_even_by_a_syncer_that_missed_its_expiry():
    """The backstop under the lease: a second writer of a published version (a syncer whose clock hid its
    expiry) is fenced by the write-once creates and changes nothing; the leftovers of a publish that died
    before its global version are overwritten."""
    store = open_store("memory://lease-once")
    prepare(store, tiny_config("lease-once"))
    syncer = Syncer.open(store, poll_s=0)
    published = []
    publish = syncer.files.publish

    def publish_then_note(proposal, record):  # on the publisher's thread: noted once it is in the store
        out = publish(proposal, record)
        published.append((proposal, record))
        return out

    syncer.files.publish = publish_then_note
    learners = [Learner.open(store, i) for i in range(2)]
    for learner in learners:
        learner.start()
    wait_for("a merge", lambda: syncer.step() or published, learners)
    proposal, record = published[0]
    p, v = record.fragment_id, proposal.version
    before = {
        k: store.get(k)
        for k in (keys.global_key(p, v), keys.momentum_key(p, v), keys.round_record_key(record.round))
    }
    other = SyncerFiles(RunRoot(store, "lease-once", None), read_layout(store))
    forged = dataclasses.replace(proposal, theta={n: t + 1 for n, t in proposal.theta.items()})
    with pytest.raises(Fenced, match=f"version {v} of fragment {p}"):
        other.publish(forged, dataclasses.replace(record, epoch=7))
    assert {k: store.get(k) for k in before} == before, "the published version is untouched"
    assert wire.unpack(store.get(keys.global_key(p, v))).meta["epoch"] == syncer.lease.epoch

    # A publish that died after its momentum and round record, before its global version: a successor
    # overwrites them and publishes the version.
    nxt = dataclasses.replace(forged, version=v + 1)
    rec = dataclasses.replace(record, round=record.round + 1000, version=v + 1, epoch=7)
    store.put(keys.momentum_key(p, v + 1), b"left by a dead syncer")
    store.put_json(keys.round_record_key(rec.round), {"left": "by a dead syncer"})
    other.publish(nxt, rec)
    assert store.get_json(keys.round_record_key(rec.round))["epoch"] == 7
    assert wire.unpack(store.get(keys.momentum_key(p, v + 1))).meta["epoch"] == 7
