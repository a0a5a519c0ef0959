"""Link shaping: parsing, the token bucket and the shaped store, on a fake clock (deterministic, instant)."""

import threading

import pytest

from ddiloco.config.recipes import load_config
from ddiloco.errors import ConfigError
from ddiloco.store.shaped import (
    Link,
    ShapedStore,
    TokenBucket,
    link_delay_seconds,
    parse_bandwidth,
    parse_latency,
    shape,
)
from ddiloco.store.url import open_store


class FakeClock:
    """A clock that only moves when someone sleeps on it."""

    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


@pytest.mark.parametrize(
    "text, bytes_per_s",
    [
        ("10Mbit", 1.25e6),
        ("100Mbit", 12.5e6),
        ("1Gbit", 125e6),
        ("1 Gbit/s", 125e6),
        ("2.5Gbps", 312.5e6),
        ("64kbit", 8000.0),
        ("5MB/s", 5e6),
        ("5MBps", 5e6),
        ("512KiB/s", 512 * 1024.0),
        ("800bit", 100.0),
        ("10mbit", 1.25e6),
    ],
)
def test_bandwidth_strings(text, bytes_per_s):
    assert parse_bandwidth(text) == pytest.approx(bytes_per_s)


@pytest.mark.parametrize(
    "text", ["10", "10M", "fast", "10 Mbit per s", "-5Mbit", "0Mbit", "10Xbit", "", "Mbit"]
)
def test_bad_bandwidth_says_the_accepted_form(text):
    with pytest.raises(ValueError, match=r"10Mbit.*5MB/s"):
        parse_bandwidth(text)


@pytest.mark.parametrize(
    "text, seconds", [("50ms", 0.05), ("0.2s", 0.2), ("800us", 8e-4), ("0ms", 0.0), (" 80 ms", 0.08)]
)
def test_latency_strings(text, seconds):
    assert parse_latency(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["50", "50 msec", "fast", "-1ms", "2min", "61s"])
def test_bad_latency_says_the_accepted_form(text):
    with pytest.raises(ValueError, match=r"50ms"):
        parse_latency(text)


def test_link_section_of_the_config_is_validated_with_the_key_and_the_form():
    cfg = load_config(None, None, ["link.bandwidth=10Mbit", "link.latency=50ms"])
    assert Link.from_config(cfg.link) == Link(bandwidth=1.25e6, latency=0.05)
    assert load_config().link is None and Link.from_config(None) is None
    with pytest.raises(ConfigError, match=r"link: bad bandwidth '10Mbt'.*10Mbit"):
        load_config(None, None, ["link.bandwidth=10Mbt"])
    with pytest.raises(ConfigError, match=r"link: bad latency '50sec'.*50ms"):
        load_config(None, None, ["link.latency=50sec"])
    with pytest.raises(ConfigError, match="did you mean 'link.latency'"):
        load_config(None, None, ["link.latncy=50ms"])


def test_token_bucket_paces_reservations_first_come_first_served():
    clock = FakeClock()
    bucket = TokenBucket(1000.0, burst=100.0, clock=clock)
    assert bucket.reserve(100) == 0.0  # the burst passes at once
    assert bucket.reserve(500) == pytest.approx(0.5)
    assert bucket.reserve(250) == pytest.approx(0.75)  # queued behind the first
    clock.now += 0.75
    assert bucket.reserve(0) == 0.0
    clock.now += 10.0  # idle: the credit is capped at the burst
    assert bucket.reserve(100) == 0.0
    assert bucket.reserve(1) == pytest.approx(0.001)


def test_token_bucket_refuses_a_non_positive_rate():
    with pytest.raises(ValueError):
        TokenBucket(0.0)


def _shaped(name, link):
    clock = FakeClock()
    store = ShapedStore(open_store(f"memory://{name}"), link, clock=clock, sleep=clock.sleep)
    return store, clock


def test_put_and_get_pay_a_round_trip_and_their_transfer_each_way_separately():
    store, clock = _shaped("shaped-rt", Link(bandwidth=1e6, latency=0.05))
    burst = store.up.capacity
    store.put("a/blob", b"x" * 1_000_000)
    put_s = (1_000_000 - burst) / 1e6 + 0.1
    assert clock.now - 100.0 == pytest.approx(put_s)
    t = clock.now
    assert store.get("a/blob") == b"x" * 1_000_000  # the download bucket is independent of the upload's
    assert clock.now - t == pytest.approx((1_000_000 - burst) / 1e6 + 0.1)
    t = clock.now
    assert store.exists("a/blob") and store.list("a") == ["a/blob"]
    store.delete("a/blob")
    assert clock.now - t == pytest.approx(3 * 0.1)
    snap = store.link_stats.snapshot()
    assert snap["bytes_up"] == snap["bytes_down"] == 1_000_000 and snap["requests"] == 5
    assert snap["seconds"] == pytest.approx(clock.now - 100.0)


def test_children_share_the_link_and_the_inner_store_sees_the_objects():
    store, clock = _shaped("shaped-child", Link(bandwidth=1e4, latency=0.0))
    child = store.child("learners")
    child.put("k", b"y" * 20_000)
    t = clock.now
    store.put("other", b"z" * 10_000)  # behind the child's transfer: one link
    assert clock.now - t == pytest.approx(1.0)
    assert open_store("memory://shaped-child").get("learners/k") == b"y" * 20_000


def test_time_slept_on_the_main_thread_is_counted_apart():
    store, _ = _shaped("shaped-threads", Link(latency=0.01))
    store.put("a", b"1")
    worker = threading.Thread(target=lambda: store.put("b", b"2"))
    worker.start()
    worker.join()
    snap = store.link_stats.snapshot()
    assert snap["seconds"] == pytest.approx(0.04) and snap["main_thread_seconds"] == pytest.approx(0.02)


def test_shape_leaves_an_unlimited_store_alone():
    base = open_store("memory://shaped-none")
    assert shape(base, None) is base and shape(base, Link()) is base
    assert isinstance(shape(base, Link(latency=0.05)), ShapedStore)


def test_allreduce_and_transfer_delays():
    link = Link(bandwidth=1e6, latency=0.05)
    assert link.transfer_seconds(1_000_000) == pytest.approx(1.05)
    # ring over 4 ranks: 6 hops of 250 kB, each with the one-way latency
    assert link.allreduce_seconds(1_000_000, 4) == pytest.approx(6 * (0.05 + 0.25))
    assert link.allreduce_seconds(1_000_000, 1) == 0.0
    assert link_delay_seconds(1_000_000, "8Mbit", "50ms") == pytest.approx(1.05)
    assert link_delay_seconds(1_000_000, "8Mbit", "50ms", world_size=4) == pytest.approx(1.8)
    assert link_delay_seconds(1_000_000, None, None) == 0.0
