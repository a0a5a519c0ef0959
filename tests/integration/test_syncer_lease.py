"""Two syncers on one run, in one process over a memory store: the holder's renewals are delayed by a store
wrapper, the standby takes the lease over, the old holder stops publishing and exits with FENCED_EXIT."""

from __future__ import annotations

import argparse
import threading
import time

from ddiloco import keys
from ddiloco.cli.roles import run_syncer
from ddiloco.learner.loop import Learner
from ddiloco.posttrain.summary import build_summary, read_round_records
from ddiloco.prepare import prepare
from ddiloco.store.url import open_store
from ddiloco.store.wrapped import DelegatingStore
from ddiloco.syncer.lease import FENCED_EXIT, Lease
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
        learner._finish("done")
    a.join(timeout=30)
    b.join(timeout=30)
    assert codes == {"a": FENCED_EXIT, "b": 0}

    records = read_round_records(store)
    by_a = [r for r in records if r["epoch"] == 1]
    assert by_a and [r for r in records if r["epoch"] == 2], "both published, one after the other"
    assert max(r["merged_at"] for r in by_a) < taken_at, "epoch 1 published nothing after the takeover"
    s = build_summary(store)
    assert s["versions_by_multiple_epochs"] == 0 and s["syncer_epochs"] == [1, 2]
    assert s["global_versions_contiguous"] and s["ledger_balanced"]
    assert store.get_json(keys.SYNCER_STATE)["epoch"] == 2
