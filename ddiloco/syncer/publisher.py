"""Publishing beside the loop: a merge's writes run on one publisher thread while the syncer's loop goes on
collecting and merging the rounds of other fragments.

One thread publishes in the order publishes were handed over, each in the persist order of
`ddiloco.syncer.state.SyncerFiles.publish`; the loop commits a publish only once it returned, so every crash
point is one a restart handles. At most `depth` publishes (one by default) wait uncommitted, each holding one
fragment's proposal. A second thread deletes what committed rounds left. Whatever a publish raised is
re-raised in the loop at its commit: `Superseded` is adopted, a `StoreError` leaves the proposal to be
published again, and `Fenced` or any other exception ends the loop.

Design notes (the measured depth): docs/internals.md, "Publishing beside the loop".
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

from ddiloco.protocol.messages import RoundRecord
from ddiloco.store.base import StoreError
from ddiloco.syncer.fragment import Proposal
from ddiloco.syncer.rounds import Round
from ddiloco.syncer.state import SyncerFiles

log = logging.getLogger(__name__)

DEPTH = 1


@dataclass(slots=True)
class Pending:
    """A merge to publish: kept as it is until it is persisted (a failed publish is retried with it)."""

    proposal: Proposal
    record: RoundRecord
    published_at: float
    """Wall time before anything of it was written (no learner can hold the version earlier)."""
    began: float
    """The syncer's clock when the merge began."""
    merge_seconds: float
    """How long proposing it took."""


@dataclass(slots=True)
class InFlight:
    """A merge handed to the publisher, not yet committed."""

    rnd: Round
    pending: Pending
    future: Future[tuple[int, float]]
    """The publish: (bytes of the global payloads, seconds it took), or what it raised."""


class Publisher:
    def __init__(self, files: SyncerFiles, depth: int = DEPTH, beside: bool = True) -> None:
        """`beside`: False runs cleaning inline and the loop waits for each publish (a lock-step,
        deterministic in-process run)."""
        self.files, self.depth, self.beside = files, depth, beside
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ddiloco-publisher")
        self._cleaner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ddiloco-cleaner")
        self._cleaning: Future[None] | None = None
        self.flight: dict[int, InFlight] = {}
        """Round -> its merge in flight, in the order handed over."""

    def busy(self) -> bool:
        return len(self.flight) >= self.depth

    def holds(self, round_: int) -> bool:
        return round_ in self.flight

    def submit(self, rnd: Round, pending: Pending) -> None:
        future = self._thread.submit(self._publish, pending)
        self.flight[rnd.round] = InFlight(rnd, pending, future)

    def _publish(self, pending: Pending) -> tuple[int, float]:
        t0 = time.perf_counter()
        written = self.files.publish(pending.proposal, pending.record)
        return written, time.perf_counter() - t0

    def finished(self, wait: bool = False) -> list[InFlight]:
        """The merges whose publish returned (or raised), oldest first, stopping at the first still running
        (commits keep the order of publishes); `wait`: all of them, waiting."""
        out = []
        for round_, f in list(self.flight.items()):
            if not (wait or f.future.done()):
                break
            f.future.exception()  # waits when asked to
            out.append(self.flight.pop(round_))
        return out

    def wait_any(self, timeout: float) -> None:
        """Sleep up to `timeout` seconds, waking as soon as the oldest publish in flight returns (the loop's
        idle wait: a round published is committed and the next one may open without a poll's delay)."""
        oldest = next(iter(self.flight.values()), None)
        if oldest is None:
            time.sleep(timeout)
        else:
            wait([oldest.future], timeout=timeout)

    def clean(self, fn: Callable[[], None]) -> None:
        """Run `fn` (deleting what a committed round left: its updates, pruned versions) on the cleaner's
        thread, in order: unlinking a round's objects takes a fragment's worth of page-cache work the loop
        need not wait for. What it raises is logged (what is left is swept at the fragment's next merge);
        not `beside`: here and now, in the loop's order."""
        if self.beside:
            self._cleaning = self._cleaner.submit(_logged, fn)
        else:
            fn()

    def wait_clean(self) -> None:
        if self._cleaning is not None:
            self._cleaning.result()

    def close(self) -> None:
        self._thread.shutdown(wait=True)
        self._cleaner.shutdown(wait=True)


def _logged(fn: Callable[[], None]) -> None:
    try:
        fn()
    except StoreError as e:
        log.warning("syncer: cleaning after a merge deferred (%s)", e)
