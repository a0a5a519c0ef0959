"""The syncer lease (`ddiloco.syncer.lease`) against the memory and file stores: take, renew, stand by, take
over on expiry or release, fenced by a newer epoch. Clocks are driven by hand (no renewal thread) except
where the thread itself is under test."""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time

import pytest

from ddiloco import keys
from ddiloco.errors import ConfigError
from ddiloco.store.url import open_store
from ddiloco.store.wrapped import OutageStore
from ddiloco.syncer.lease import Fenced, Lease, LeaseConfig

CFG = LeaseConfig(min_s=10.0, factor=3.0, renew_every_s=1.0)


@pytest.fixture(params=["memory", "file"])
def store(request, tmp_path):
    if request.param == "memory":
        return open_store(f"memory://lease-{secrets.token_hex(4)}")
    return open_store(f"file://{tmp_path}/run")


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def lease(store, clock, cfg=CFG) -> Lease:
    return Lease(store, "r", cfg, clock=clock, keep_renewing=False)


def test_the_first_syncer_takes_epoch_1_with_a_write_once_claim(store):
    clock = Clock()
    a = lease(store, clock)
    assert a.try_take() and a.epoch == 1
    claim = store.get_json(keys.lease_claim_key(1))
    assert (
        claim["epoch"] == 1 and claim["seq"] == 0 and claim["lease_s"] == 10.0 and claim["nonce"] == a.nonce
    )
    a.check()  # holds the newest epoch: nothing to say


def test_a_standby_waits_while_the_holder_renews_and_takes_over_when_it_stops(store):
    clock = Clock()
    a, b = lease(store, clock), lease(store, clock)
    assert a.try_take()
    assert not b.try_take()  # first sight of renewal seq 0: its clock starts now
    for _ in range(5):  # renewals every 8 s, lease 10 s: never expires
        clock.t += 8.0
        a.renew()
        assert not b.try_take()
    assert store.get_json(keys.lease_renewal_key(1))["seq"] == 5
    clock.t += 9.9
    assert not b.try_take()
    clock.t += 0.2  # 10.1 s without a new renewal
    assert b.try_take() and b.epoch == 2
    with pytest.raises(Fenced, match="epoch 2 took over from epoch 1"):
        a.check()
    with pytest.raises(Fenced):
        a.renew()
    with pytest.raises(Fenced):
        a.raise_if_fenced()  # remembered, no I/O needed


def test_a_holder_that_lapsed_renews_before_publishing_and_learns_of_a_takeover(store):
    clock = Clock()
    a, b = lease(store, clock), lease(store, clock)
    assert a.try_take()
    clock.t += 9.5
    a.check(publish_s=0.1)  # 0.4 s left is enough for a 0.1 s publish: no renewal
    assert not store.exists(keys.lease_renewal_key(1))
    a.check(publish_s=1.0)  # not enough: renews first
    assert store.get_json(keys.lease_renewal_key(1))["seq"] == 1
    # A paused holder: the standby sees nothing change for a whole lease and claims epoch 2; the holder's
    # next check renews (its validity lapsed long ago) and finds the newer claim after its renewal landed.
    b.try_take()
    clock.t += 60.0
    assert b.try_take() and b.epoch == 2
    with pytest.raises(Fenced):
        a.check()


def test_a_released_lease_is_taken_at_once(store):
    clock = Clock()
    a, b = lease(store, clock), lease(store, clock)
    assert a.try_take()
    assert not b.try_take()
    a.release()
    assert store.get_json(keys.lease_renewal_key(1))["released"] is True
    assert b.try_take() and b.epoch == 2
    with pytest.raises(Fenced, match="released"):
        a.check()


def test_of_racing_claimants_exactly_one_gets_each_epoch(store):
    leases = [Lease(store, "r", CFG, keep_renewing=False) for _ in range(8)]
    barrier = threading.Barrier(len(leases))
    won = []

    def take(x: Lease) -> None:
        barrier.wait()
        if x.try_take():
            won.append(x)

    threads = [threading.Thread(target=take, args=(x,)) for x in leases]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1 and won[0].epoch == 1
    assert [keys.lease_epoch_of(k) for k in store.list(keys.lease_claim_prefix())] == [1]


def test_seize_fences_the_holder_at_once(store):
    clock = Clock()
    a, b = lease(store, clock), lease(store, clock)
    assert a.try_take()
    b.seize()
    assert b.epoch == 2
    with pytest.raises(Fenced):
        a.check()


def test_a_standby_says_so_once_and_the_holder_lists_it(store, caplog):
    a = Lease(store, "r", LeaseConfig(min_s=0.4, renew_every_s=0.1))
    assert a.try_take()  # renews from its thread from now on
    b = Lease(store, "r", LeaseConfig(min_s=0.4, renew_every_s=0.1))
    polls = []

    def done() -> bool:
        polls.append(1)
        return len(polls) > 8

    with caplog.at_level(logging.INFO, logger="ddiloco.syncer.lease"):
        assert b.acquire(done=done) is False  # the holder kept renewing: still standing by when done
    standing = [r.message for r in caplog.records if "standing by" in r.message]
    assert len(standing) == 1 and "epoch 1" in standing[0], standing
    assert not store.exists(keys.lease_standby_key(b.nonce)), "a standby that leaves takes its entry along"
    c = Lease(store, "r", LeaseConfig(min_s=0.4, renew_every_s=0.1), keep_renewing=False)
    c.try_take()
    c._announce()
    deadline = time.monotonic() + 5  # the holder lists standbys at its renewals
    while len(a.standbys()) != 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [s.pid for s in a.standbys()] == [os.getpid()]
    store.put_json(keys.lease_standby_key("junk"), {"host": 1})  # a malformed one is skipped, not fatal
    time.sleep(0.3)
    assert len(a.standbys()) == 1
    a.release()


def test_a_holder_that_stops_renewing_is_taken_over_by_a_waiting_standby(store):
    a = Lease(store, "r", LeaseConfig(min_s=0.4, renew_every_s=0.1))
    assert a.try_take()
    b = Lease(store, "r", LeaseConfig(min_s=0.4, renew_every_s=0.1))
    taken = []
    t = threading.Thread(target=lambda: taken.append(b.acquire()))
    t.start()
    time.sleep(1.0)
    assert not taken, "the holder renews: the standby waits"
    a._stop.set()  # the holder's renewals stop (as if its process hung)
    start = time.monotonic()
    t.join(timeout=10)
    assert taken == [True] and b.epoch == 2
    assert time.monotonic() - start < 0.4 + 0.5 + 0.5, "took over within the lease plus a poll"
    with pytest.raises(Fenced):
        a.check()
    b.release()


def test_the_lease_grows_with_the_store_latency_and_the_merge_time(store):
    clock = Clock()
    a = lease(store, clock, LeaseConfig(min_s=2.0, factor=3.0, renew_every_s=1.0))
    assert a.try_take() and a.lease_s == 3.0  # 3 × (1 s interval + ~0 latency)
    a.check(publish_s=4.0)  # renews: it has 3 s left, a publish takes 4 s
    assert (
        a.lease_s == pytest.approx(15.0) and store.get_json(keys.lease_renewal_key(1))["lease_s"] == a.lease_s
    )


@pytest.mark.parametrize(
    "cfg", [dict(min_s=1.0, renew_every_s=1.0), dict(renew_every_s=0.0), dict(factor=1.5)]
)
def test_bad_lease_settings_say_what_to_change(cfg):
    with pytest.raises(ConfigError, match="lease"):
        LeaseConfig(**cfg).validate()


def test_a_store_outage_longer_than_the_lease_does_not_hand_the_lease_over(store):
    """Neither the holder nor the standby reaches the store for 13 s (lease 10 s): the standby's count of
    the holder's silence starts again after the outage, and the holder renews first."""
    clock = Clock()
    a = lease(store, clock)
    assert a.try_take()
    down = [False]
    flaky = OutageStore(store, [(0.0, 1.0)], clock=lambda: 0.5 if down[0] else 2.0)
    renewed = [clock.t]

    def sleep(
        s: float,
    ) -> None:  # the holder renews every 8 s once the store answers, after the standby's poll
        if not down[0] and clock.t - renewed[-1] >= 8.0:
            a.renew()
            renewed.append(clock.t)
        clock.t += s
        down[0] = 102.0 <= clock.t < 115.0

    b = Lease(flaky, "r", CFG, clock=clock, sleep=sleep, keep_renewing=False)
    assert b.acquire(done=lambda: clock.t > 140.0) is False and b.epoch == 0
    assert flaky.refused > 0 and renewed[1] == 115.0
    a.check()


def test_a_holder_whose_loop_hangs_stops_renewing_and_is_taken_over(store, caplog):
    """The renewal thread runs apart from the syncer's loop; without the watchdog a syncer stuck in its loop
    (a deadlock, a hung store call) would keep renewing forever and no standby could take over."""
    cfg = LeaseConfig(min_s=0.4, renew_every_s=0.1, stuck_s=0.6)
    a = Lease(store, "r", cfg)
    assert a.try_take()
    b = Lease(store, "r", cfg)
    taken = []
    t = threading.Thread(target=lambda: taken.append(b.acquire()))
    t.start()
    for _ in range(10):  # the loop makes passes: the lease is kept
        a.renew_if_due()
        time.sleep(0.1)
    assert not taken, "a live loop keeps its lease"
    start = time.monotonic()  # the loop hangs: no more passes
    with caplog.at_level(logging.ERROR, logger="ddiloco.syncer.lease"):
        t.join(timeout=10)
    assert taken == [True] and b.epoch == 2
    assert time.monotonic() - start < 0.6 + 0.4 + 1.0, "taken over within stuck_s plus the lease and a poll"
    assert any("made no pass" in r.getMessage() for r in caplog.records)
    with pytest.raises(Fenced):
        a.check()  # the syncer wakes up: it is fenced, it publishes nothing
    a.release()
    b.release()


def test_stuck_s_shorter_than_the_lease_is_refused():
    with pytest.raises(ConfigError, match="stuck_s"):
        LeaseConfig(min_s=10.0, stuck_s=5.0).validate()
