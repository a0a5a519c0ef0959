"""Link shaping: a learner behind a slow WAN link, emulated in the store client so it works on every backend.

A `Link` is a bandwidth limit and an added one-way latency, parsed from strings such as `10Mbit`, `5MB/s`,
`50ms` (anything else is refused with the accepted forms). `ShapedStore` wraps any store: uploads and
downloads are limited separately (a full-duplex link: two token buckets), and every request pays a round
trip. One `ShapedStore` per process, its children sharing the buckets, so one learner's transfers share its
link. The bucket never busy-waits (a reservation returns how long to sleep); clock and sleep are
injectable. The same `Link` prices the baseline's ring all-reduce (`allreduce_seconds`), and time slept on
the main thread is counted apart (`LinkStats.main_thread_seconds`), since shaping must never block training.

Design notes (how each request is priced): docs/internals.md, "Slow links".
"""

from __future__ import annotations

import dataclasses
import logging
import re
import threading
import time
from collections.abc import Callable
from typing import Any

from ddiloco.store.base import Store
from ddiloco.store.blob import Data
from ddiloco.store.wrapped import DelegatingStore

logger = logging.getLogger(__name__)

__all__ = [
    "BANDWIDTH_FORMS",
    "LATENCY_FORMS",
    "Link",
    "LinkStats",
    "ShapedStore",
    "TokenBucket",
    "link_delay_seconds",
    "parse_bandwidth",
    "parse_latency",
    "shape",
]

BANDWIDTH_FORMS = "a number and a unit: 10Mbit, 100Mbit, 1Gbit, 2.5Gbps (bits/s) or 5MB/s, 512KiB/s (bytes/s)"
LATENCY_FORMS = "a number and a unit: 50ms, 0.2s or 800us"

_PREFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_BINARY = {"ki": 2.0**10, "mi": 2.0**20, "gi": 2.0**30, "ti": 2.0**40}
_BANDWIDTH_RE = re.compile(
    r"(?P<num>\d+(?:\.\d*)?|\.\d+)\s*(?P<prefix>[kKmMgGtT]i?)?(?P<unit>bit(?:/s)?|bps|b/s|B/s|Bps|B)"
)
_LATENCY_RE = re.compile(r"(?P<num>\d+(?:\.\d*)?|\.\d+)\s*(?P<unit>us|µs|ms|s)")
_LATENCY_UNIT = {"us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0}
MAX_LATENCY_S = 60.0


def _match(text: str, what: str, pattern: re.Pattern[str], forms: str) -> re.Match[str]:
    """`text` matched by `pattern` as a whole; ValueError naming the accepted forms."""
    if not isinstance(text, str):
        raise ValueError(f"{what} {text!r} must be a string: {forms}")
    m = pattern.fullmatch(text.strip())
    if m is None:
        raise ValueError(f"bad {what} {text!r}: use {forms}")
    return m


def parse_bandwidth(text: str) -> float:
    """Bytes per second from a string like `10Mbit` or `5MB/s`; ValueError naming the accepted forms."""
    m = _match(text, "bandwidth", _BANDWIDTH_RE, BANDWIDTH_FORMS)
    prefix = (m["prefix"] or "").lower()
    scale = _BINARY[prefix] if prefix.endswith("i") else _PREFIX[prefix]
    bits = m["unit"].startswith("b")  # bit, bps, b/s: bits; B, B/s, Bps: bytes
    value = float(m["num"]) * scale / (8.0 if bits else 1.0)
    if value <= 0:
        raise ValueError(f"bad bandwidth {text!r}: it must be > 0 (null for no limit); use {BANDWIDTH_FORMS}")
    return value


def parse_latency(text: str) -> float:
    """Seconds from a string like `50ms`; ValueError naming the accepted forms."""
    m = _match(text, "latency", _LATENCY_RE, LATENCY_FORMS)
    value = float(m["num"]) * _LATENCY_UNIT[m["unit"]]
    if value > MAX_LATENCY_S:
        raise ValueError(f"bad latency {text!r}: at most {MAX_LATENCY_S:.0f}s (it is one-way, e.g. 50ms)")
    return value


@dataclasses.dataclass(frozen=True, slots=True)
class Link:
    """A parsed link: `bandwidth` in bytes/s per direction (None: unlimited), one-way `latency` in seconds."""

    bandwidth: float | None = None
    latency: float = 0.0

    @classmethod
    def parse(cls, bandwidth: str | None = None, latency: str | None = None) -> Link:
        return cls(
            bandwidth=None if bandwidth is None else parse_bandwidth(bandwidth),
            latency=0.0 if latency is None else parse_latency(latency),
        )

    @classmethod
    def from_config(cls, cfg: Any) -> Link | None:
        """The link of a `LinkConfig` (None: no link section, or one that limits nothing)."""
        if cfg is None:
            return None
        link = cls.parse(cfg.bandwidth, cfg.latency)
        return link if link.limited else None

    @property
    def limited(self) -> bool:
        return self.bandwidth is not None or self.latency > 0

    def transfer_seconds(self, nbytes: int) -> float:
        """One-way delivery time of `nbytes`: latency + serialization at the bandwidth."""
        return self.latency + (nbytes / self.bandwidth if self.bandwidth else 0.0)

    def allreduce_seconds(self, nbytes: int, world_size: int) -> float:
        """A bandwidth-optimal ring all-reduce of an `nbytes` payload over `world_size` ranks behind this
        link: 2(M−1) sequential hops, each sending payload/M and paying the one-way latency."""
        if world_size <= 1:
            return 0.0
        hops = 2 * (world_size - 1)
        return hops * self.transfer_seconds(int(nbytes / world_size))

    def describe(self) -> str:
        bw = "unlimited" if self.bandwidth is None else f"{self.bandwidth * 8 / 1e6:g} Mbit/s"
        return f"{bw}, {self.latency * 1e3:g} ms one-way"


def link_delay_seconds(
    nbytes: int, bandwidth: str | None, latency: str | None, *, world_size: int | None = None
) -> float:
    """Seconds `nbytes` take over a link given as strings (e.g. "10Mbit", "50ms"): one transfer, or with
    `world_size` a ring all-reduce of that payload (what the data-parallel baseline sleeps per all-reduce)."""
    link = Link.parse(bandwidth, latency)
    return link.transfer_seconds(nbytes) if world_size is None else link.allreduce_seconds(nbytes, world_size)


class TokenBucket:
    """Bytes/s limiter: `reserve(n)` takes n tokens (possibly into debt) and returns the seconds to wait."""

    def __init__(self, rate: float, burst: float | None = None, clock: Callable[[], float] = time.monotonic):
        if rate <= 0:
            raise ValueError(f"TokenBucket rate must be > 0, got {rate}")
        self.rate = float(rate)
        self.capacity = float(burst) if burst is not None else max(16 * 1024.0, 0.01 * self.rate)
        self.clock = clock
        self.tokens = self.capacity
        self.last = clock()
        self._lock = threading.Lock()

    def reserve(self, nbytes: int) -> float:
        with self._lock:
            now = self.clock()
            self.tokens = min(self.capacity, self.tokens + (now - self.last) * self.rate)
            self.last = now
            self.tokens -= nbytes
            return max(0.0, -self.tokens / self.rate)


@dataclasses.dataclass
class LinkStats:
    """What shaping cost, in seconds slept (all threads / the main thread) and bytes through each bucket."""

    requests: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    seconds: float = 0.0
    main_thread_seconds: float = 0.0
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, seconds: float, up: int = 0, down: int = 0) -> None:
        main = threading.current_thread() is threading.main_thread()
        with self._lock:
            self.requests += 1
            self.bytes_up += up
            self.bytes_down += down
            self.seconds += seconds
            if main:
                self.main_thread_seconds += seconds

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return {
                f.name: getattr(self, f.name) for f in dataclasses.fields(self) if not f.name.startswith("_")
            }


class ShapedStore(DelegatingStore):
    """A store reached through a `Link` (see the module docstring for the model)."""

    def __init__(
        self,
        inner: Store,
        link: Link,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        super().__init__(inner)
        self.link = link
        self.sleep = sleep
        self.up = TokenBucket(link.bandwidth, clock=clock) if link.bandwidth else None
        self.down = TokenBucket(link.bandwidth, clock=clock) if link.bandwidth else None
        self.link_stats = LinkStats()

    def _wait(self, seconds: float) -> None:
        if seconds > 0:
            self.sleep(seconds)

    def _put(self, full_key: str, data: Data) -> None:
        transfer = self.up.reserve(len(data)) if self.up else 0.0
        self._wait(self.link.latency + transfer)  # the request and its body reach the store
        self.inner._put(self.inner._full(full_key), data)
        self._wait(self.link.latency)  # the answer comes back
        self.link_stats.add(2 * self.link.latency + transfer, up=len(data))

    def _create(self, full_key: str, data: Data, strict: bool) -> bool:
        """Priced like a put whatever the outcome: the body goes up before the store can refuse it."""
        transfer = self.up.reserve(len(data)) if self.up else 0.0
        self._wait(self.link.latency + transfer)
        created = self.inner._create(self.inner._full(full_key), data, strict)
        self._wait(self.link.latency)
        self.link_stats.add(2 * self.link.latency + transfer, up=len(data))
        return created

    def _get(self, full_key: str, max_bytes: int | None) -> bytes:
        self._wait(self.link.latency)
        data = self.inner._get(self.inner._full(full_key), max_bytes)
        transfer = self.down.reserve(len(data)) if self.down else 0.0
        self._wait(self.link.latency + transfer)
        self.link_stats.add(2 * self.link.latency + transfer, down=len(data))
        return data

    def _get_range(self, full_key: str, offset: int, length: int) -> bytes:
        self._wait(self.link.latency)
        data = self.inner._get_range(self.inner._full(full_key), offset, length)
        transfer = self.down.reserve(len(data)) if self.down else 0.0
        self._wait(self.link.latency + transfer)
        self.link_stats.add(2 * self.link.latency + transfer, down=len(data))
        return data

    def before(self, op: str, key: str) -> None:
        """exists, size, list and delete: one round trip (put and the gets above do not call this hook)."""
        self._wait(2 * self.link.latency)
        self.link_stats.add(2 * self.link.latency)


def shape(store: Store, link: Link | None) -> Store:
    """`store` behind `link`, or `store` itself when there is no link or it limits nothing."""
    if link is None or not link.limited:
        return store
    logger.info("store %s shaped: %s per direction", store.url, link.describe())
    return ShapedStore(store, link)
