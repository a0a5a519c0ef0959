"""Two syncer processes on one run (what an Argo retry of a still-running syncer pod amounts to), over a
file:// store: the second stands by, the first is SIGKILLed mid-run, the second takes over with the next
epoch, and no version is published twice."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddiloco import keys
from ddiloco.posttrain.summary import build_summary, read_round_records
from ddiloco.run.globalmodel import latest_version
from ddiloco.run.prepare import prepare
from ddiloco.store.base import NotFound
from ddiloco.store.url import open_store
from tests._harness import tiny_config

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
LEASE_S = 2.0
RUN = ("lease.min_s=2", "lease.renew_every_s=0.5", "diloco.token_budget=50000")


def start(url: str, role: str, log: Path, *args: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(log, "w") as f:
        argv = [sys.executable, "-m", "ddiloco.cli", role, "--store", url, *args]
        return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=f)


class Watch:
    """What a split brain shows from outside: the status written by more than one process at a time, or a
    published global version whose bytes change afterwards (two writers of one version number)."""

    def __init__(self, store) -> None:
        self.store, self.pids, self.digests, self.rewritten = store, set(), {}, set()

    def __call__(self) -> None:
        status = self.store.get_json_or_none(keys.STATUS)
        if status:
            self.pids.add(status["syncer_pid"])
        for k in self.store.list("global/"):
            if k.endswith(".safetensors"):
                try:
                    blob = self.store.get(k)
                except NotFound:  # retention pruned it since the listing (old versions and deltas go)
                    continue
                digest = hashlib.sha256(blob).hexdigest()
                if self.digests.setdefault(k, digest) != digest:
                    self.rewritten.add(k)


def wait_until(what: str, cond, procs: dict, timeout: float = 90.0, watch=None) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if watch is not None:
            watch()
        for name, (p, log) in procs.items():
            assert p.poll() is None, f"{name} exited ({p.returncode}):\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no {what} after {timeout}s"
        time.sleep(0.05)


def test_a_standby_syncer_takes_over_from_a_killed_one(tmp_path):
    url = f"file://{tmp_path}/run"
    store = open_store(url)
    prepare(store, tiny_config("lease", *RUN))
    procs = {"syncer-a": (start(url, "syncer", tmp_path / "a.log"), tmp_path / "a.log")}
    wait_until("epoch 1", lambda: store.exists(keys.lease_claim_key(1)), procs)
    procs["syncer-b"] = (start(url, "syncer", tmp_path / "b.log"), tmp_path / "b.log")
    for i in range(2):
        log = tmp_path / f"learner-{i}.log"
        procs[f"learner-{i}"] = (start(url, "learner", log, "--learner-id", str(i)), log)

    def status() -> dict:
        return store.get_json_or_none(keys.STATUS) or {}

    watch = Watch(store)
    wait_until("6 merges", lambda: status().get("rounds_merged", 0) >= 6, procs, watch=watch)
    assert watch.pids == {procs["syncer-a"][0].pid}, "only the lease holder publishes"
    wait_until("the standby in the status", lambda: status().get("standbys"), procs, watch=watch)
    standing = [line for line in (tmp_path / "b.log").read_text().splitlines() if "standing by" in line]
    assert len(standing) == 1 and "epoch 1" in standing[0], standing
    assert status()["epoch"] == 1 and not store.exists(keys.lease_claim_key(2))

    a, _ = procs.pop("syncer-a")
    killed_at = time.time()
    a.send_signal(signal.SIGKILL)
    a.wait()
    wait_until("epoch 2", lambda: store.exists(keys.lease_claim_key(2)), procs, timeout=30, watch=watch)
    taken_after = store.get_json(keys.lease_claim_key(2))["time"] - killed_at
    wait_until("the run's end", lambda: store.exists(keys.DONE), procs, timeout=180, watch=watch)
    assert not watch.rewritten, f"global versions rewritten by a second writer: {sorted(watch.rewritten)}"
    for name, (p, log) in procs.items():
        assert p.wait(timeout=60) == 0, f"{name}:\n{log.read_text()[-3000:]}"

    records = read_round_records(store)
    first_by_b = min(r["merged_at"] for r in records if r["epoch"] == 2) - killed_at
    s = build_summary(store)
    # The standby read the last renewal at most one renewal interval before the kill, and polls every half
    # interval; the first merge after it took over waits for the resume and one round.
    assert taken_after <= LEASE_S + 1.0, taken_after
    assert first_by_b <= LEASE_S + 5.0, first_by_b
    assert s.syncer_epochs == [1, 2] and s.versions_by_multiple_epochs == 0
    assert set(s.versions_by_epoch) == {"1", "2"}
    assert s.global_versions_contiguous and s.ledger_balanced and s.status == "done"
    for p in range(s.num_fragments):
        versions = sorted(r["version"] for r in records if r["fragment_id"] == p)
        assert versions == list(range(1, latest_version(store, p) + 1)), f"fragment {p}: {versions}"
    print(f"takeover: claimed {taken_after:.2f}s, first merge {first_by_b:.2f}s after the kill")
