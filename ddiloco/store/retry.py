"""Retries for transient store failures: capped exponential backoff with full jitter, bounded by attempts and time.

Full jitter (sleep uniformly in [0, min(max_delay, base_delay * 2**n)]) spreads M learners that hit the same
outage, so they do not come back in lockstep. Both an attempt cap and a deadline bound the wait: a learner
must never stall for minutes on a store hiccup; it gets `StoreUnavailable` and carries on training.
Clock, sleep and the random source are injectable so tests run instantly and deterministically.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections.abc import Callable
from typing import TypeVar

from ddiloco.store.base import StoreUnavailable

logger = logging.getLogger(__name__)

T = TypeVar("T")

__all__ = ["RetryPolicy", "call_with_retry", "until_store_answers"]


@dataclasses.dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How long to keep retrying a transient failure."""

    max_attempts: int = 8
    """Total attempts, the first included (1 = no retry)."""
    base_delay: float = 0.2
    """Upper bound of the first backoff sleep, seconds; doubles each retry."""
    max_delay: float = 5.0
    """Cap of the backoff upper bound, seconds."""
    deadline: float = 60.0
    """No attempt starts later than this many seconds after the first one."""

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"RetryPolicy.max_attempts must be >= 1, got {self.max_attempts}")
        if self.base_delay < 0 or self.max_delay < 0:
            raise ValueError(f"RetryPolicy delays must be >= 0, got {self.base_delay}, {self.max_delay}")
        if self.base_delay > self.max_delay:
            raise ValueError(f"RetryPolicy.base_delay {self.base_delay} exceeds max_delay {self.max_delay}")
        if self.deadline < 0:
            raise ValueError(f"RetryPolicy.deadline must be >= 0, got {self.deadline}")

    def backoff_bound(self, retry: int) -> float:
        """Upper bound of the sleep before retry number `retry` (1-based)."""
        return min(self.max_delay, self.base_delay * (2 ** (retry - 1)))


def call_with_retry(
    fn: Callable[[], T],
    policy: RetryPolicy,
    *,
    is_transient: Callable[[BaseException], bool],
    on_retry: Callable[[int, BaseException, float], None] | None = None,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
    rng: random.Random | None = None,
    what: str = "store operation",
) -> T:
    """Call `fn` until it succeeds, retrying errors for which `is_transient(exc)` is true.

    Non-transient errors propagate at once. When attempts or the deadline run out, raise StoreUnavailable
    chained to the last error. `on_retry(retry_number, exc, delay)` is called before each backoff sleep.
    """
    rng = rng if rng is not None else random.Random()
    start = clock()
    attempt = 0
    while True:
        attempt += 1
        try:
            return fn()
        except Exception as exc:
            if not is_transient(exc):
                raise
            elapsed = clock() - start
            remaining = policy.deadline - elapsed
            if attempt >= policy.max_attempts or remaining <= 0:
                raise StoreUnavailable(
                    f"{what} failed after {attempt} attempt(s) in {elapsed:.1f}s: {type(exc).__name__}: {exc}"
                ) from exc
            delay = min(rng.uniform(0.0, policy.backoff_bound(attempt)), remaining)
            logger.debug("%s: transient %s (attempt %d), retrying in %.2fs", what, exc, attempt, delay)
            if on_retry is not None:
                on_retry(attempt, exc, delay)
            sleep(delay)


def until_store_answers(make: Callable[[], T], role: str, max_wait_s: float = 600.0) -> T:
    """`make()` retried while the store is unavailable, for a role's start-up reads: a role started during an
    outage waits for the store (`call_with_retry`, backoff bound 1 s doubling to 30 s, up to `max_wait_s`)
    instead of exiting."""

    def said(_: int, e: BaseException, delay: float) -> None:
        logger.warning("%s: store unavailable at start-up (%s); retrying in %.1fs", role, e, delay)

    policy = RetryPolicy(max_attempts=1 << 30, base_delay=1.0, max_delay=30.0, deadline=max_wait_s)
    transient = lambda e: isinstance(e, StoreUnavailable)  # noqa: E731
    return call_with_retry(make, policy, is_transient=transient, on_retry=said, what=f"{role} start-up")
