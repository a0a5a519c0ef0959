"""The learner's health: exceptions of its I/O threads are never lost, and it stops training when none of its
answers gets merged for too long.

Every function the I/O threads run goes through `IoErrors.guarded(kind, fn)`: a store error is counted and
raised to the caller; any other exception is a bug, logged with its traceback, counted, and then swallowed
(`upload`, `heartbeat`, `checkpoint`: the next one tries again) or raised (`download`, `record`: the
learner exits). Heartbeats have a thread of their own (`Heartbeats`), so a slow upload never makes the
syncer think the learner dead. `MergeBound` raises `Unmerged` when no answer was merged for
`train.max_unmerged_s` while the run could have merged one, and `ddiloco learner` exits with
`UNMERGED_EXIT` (4) to be restarted; store and syncer outages pause that count.

Design notes (each kind's handling, what the bound counts, its cost): docs/internals.md, "Health".
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from ddiloco.config.run import DilocoConfig
from ddiloco.protocol.messages import Status
from ddiloco.store.base import StoreError
from ddiloco.tracking.metrics import LearnerMetrics

__all__ = ["Heartbeats", "IoErrors", "MergeBound", "UNMERGED_EXIT", "Unmerged", "guard"]

log = logging.getLogger(__name__)

T = TypeVar("T")

UNMERGED_EXIT = 4
"""Exit code of a learner none of whose answers was merged for the bound (`Unmerged`)."""
UNMERGED_MIN_S = 1800.0
"""The default bound's floor: half an hour of a live syncer merging without this learner."""
UNMERGED_SYNCS = 20
"""The default bound in syncs of one fragment (sync_every steps each) at the learner's own pace."""
SYNCER_SILENT_S = 120.0
"""A status unchanged for longer (or for 4 rounds at the learner's pace, if that is longer) means the syncer
is down or standing by: the bound pauses."""

NEXT = {
    "upload": "the answer's tokens stay outstanding and the next answer of that fragment carries them",
    "heartbeat": "the next heartbeat tries again",
    "checkpoint": "the next checkpoint tries again",
    "download": "the learner exits so that it is restarted",
    "record": "the learner exits so that it is restarted",
}
"""What happens after a bug in an I/O thread, by kind (module docstring)."""
RAISED = frozenset({"download", "record"})


class Unmerged(RuntimeError):
    """None of the learner's answers was merged for the bound while the store and the syncer were up."""


class IoErrors:
    """Counts and logs what the learner's I/O threads raise (module docstring)."""

    def __init__(self, metrics: LearnerMetrics, learner_id: int) -> None:
        self.metrics, self.learner_id = metrics, learner_id
        self.store_errors = 0
        """Store errors seen by the I/O threads (after the store's own retries)."""
        self._lock = threading.Lock()

    def store_error(self) -> None:
        with self._lock:
            self.store_errors += 1

    def bug(self, kind: str) -> None:
        """Log the exception being handled at ERROR with its traceback and count it under `kind`."""
        self.metrics.io_errors.labels(learner_id=str(self.learner_id), kind=kind).inc()
        log.error(
            "learner %d: %s thread raised a bug (not a store error); %s",
            self.learner_id,
            kind,
            NEXT[kind],
            exc_info=True,
        )

    def guarded(self, kind: str, fn: Callable[..., T]) -> Callable[..., T | None]:
        """`fn` as an I/O thread runs it: store errors counted and raised, bugs handled by kind."""
        if kind not in NEXT:
            raise ValueError(f"unknown I/O kind {kind!r}; one of {sorted(NEXT)}")

        def run(*args: Any) -> T | None:
            try:
                return fn(*args)
            except StoreError:
                self.store_error()
                raise
            except Exception:
                self.bug(kind)
                if kind in RAISED:
                    raise
                return None

        return run


def guard(errors: IoErrors | None, kind: str, fn: Callable[..., T]) -> Callable[..., T | None]:
    """`errors.guarded(kind, fn)`, or `fn` itself where no `IoErrors` is given (components used alone)."""
    return fn if errors is None else errors.guarded(kind, fn)


class Heartbeats:
    """Writes heartbeat reports on a thread of its own, one at a time (module docstring)."""

    def __init__(self, write: Callable[[dict[str, Any]], Any], errors: IoErrors) -> None:
        """`write`: the learner's `ReportWriter.write`."""
        self.write, self.errors = errors.guarded("heartbeat", write), errors
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"learner{errors.learner_id}-hb")
        self.last: Future | None = None

    def beat(self, build: Callable[[], dict[str, Any]]) -> None:
        """Write the report `build()` makes now, unless the last heartbeat is still being written; the last
        one's store error is logged here (a bug was logged and counted by its thread)."""
        last = self.last
        if last is not None and not last.done():
            return
        if last is not None and isinstance(last.exception(), StoreError):
            log.warning("learner %d: heartbeat not written (%s)", self.errors.learner_id, last.exception())
        self.last = self.pool.submit(self.write, build())

    def shutdown(self) -> None:
        self.pool.shutdown(wait=True)


class MergeBound:
    """The time a learner trained without a merge, counted while the run could have merged it."""

    def __init__(
        self,
        learner_id: int,
        configured_s: float | None,
        diloco: DilocoConfig,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`configured_s`: `train.max_unmerged_s` (None: by the pace); `diloco`: H and P of the run."""
        self.learner_id, self.configured_s = learner_id, configured_s
        self.sync_every, self.fragments, self.clock = diloco.sync_every, diloco.fragments, clock
        self.unmerged_s = 0.0
        """Seconds counted since the last merge (or the start)."""
        self._last = self._changed_at = clock()
        self._mark: tuple[Any, ...] | None = None
        self._merged = 0
        self._errors = 0

    def begin(self) -> None:
        """Start counting now (the learner joined the run)."""
        self._last = self._changed_at = self.clock()
        self.unmerged_s = 0.0

    def bound_s(self, step_s: float | None) -> float:
        """The bound in seconds at `step_s` wall seconds per step (None: not measured yet)."""
        if self.configured_s is not None:
            return self.configured_s
        return max(UNMERGED_MIN_S, UNMERGED_SYNCS * self.sync_every * (step_s or 0.0))

    def silent_s(self, step_s: float | None) -> float:
        """How long an unchanged status still counts as a live syncer."""
        return max(SYNCER_SILENT_S, 4 * self.sync_every / self.fragments * (step_s or 0.0))

    def check(
        self, status: Status | None, merged_tokens: int, store_errors: int, step_s: float | None
    ) -> None:
        """At a step boundary: add the time since the last check if the run could merge this learner then,
        restart the count on a new merge (`merged_tokens` grew); `Unmerged` once the count reaches the bound."""
        now = self.clock()
        dt, self._last = now - self._last, now
        mark = None if status is None else (status.epoch, status.time, status.next_round)
        if mark != self._mark:
            self._mark, self._changed_at = mark, now
        silent = self.silent_s(step_s)
        up = status is not None and store_errors == self._errors and now - self._changed_at <= silent
        self._errors = store_errors
        if merged_tokens > self._merged:
            self._merged, self.unmerged_s = merged_tokens, 0.0
        elif up:
            self.unmerged_s += min(dt, silent)
        bound = self.bound_s(step_s)
        if self.unmerged_s >= bound:
            raise Unmerged(
                f"learner {self.learner_id}: none of its answers was merged in {self.unmerged_s:.0f} s of "
                f"training while the store answered and the syncer published (bound {bound:.0f} s, "
                "train.max_unmerged_s); exiting so that it is restarted. Look above for ERROR lines of its "
                "I/O threads (ddiloco_learner_io_errors_total) and the syncer's rejections of its answers"
            )
