"""One tracking backend behind a bounded queue and the thread that drains it: nothing that logs ever waits.

Design choices:
- `Channel.put` is `Queue.put_nowait`: when the backend is down or slow its queue fills, and what does not
  fit is dropped and counted (`ddiloco_tracking_dropped_events_total{backend}`); so is a batch whose write
  raised. The first drop logs ONE warning per channel saying what happened and what to check; later ones
  are counted only (debug log).
- The drain thread writes events in batches (a backend may send one request per batch) and asks the
  backend to `flush` every `flush_every_s` and at close; a backend keeps what a flush could not deliver.
- `close(timeout)` waits at most `timeout` for the thread; a backend that hangs past it is left behind on
  its daemon thread, its queued events counted as dropped: a process never waits on tracking to exit.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

log = logging.getLogger(__name__)

BATCH = 500
"""Most events handed to a backend's `write` at once."""


@dataclass(frozen=True, slots=True)
class Scalars:
    values: Mapping[str, float]
    step: int
    wall_time: float


@dataclass(frozen=True, slots=True)
class Params:
    values: Mapping[str, str]


@dataclass(frozen=True, slots=True)
class Artifacts:
    """Every object under the store prefix `prefix`, logged as the artifact directory `name`."""

    prefix: str
    name: str


Event = Scalars | Params | Artifacts
_STOP = object()


class Backend(Protocol):
    name: str
    """Label of the dropped-events counter and of the warning (tensorboard, mlflow)."""

    def write(self, events: list[Event]) -> None:
        """Take `events` (raise: they are dropped and counted)."""

    def flush(self) -> None:
        """Deliver what `write` took (raise: kept, tried again at the next flush)."""

    def close(self, finished: bool) -> None:
        """Last flush; `finished`: the role ended normally."""


class Channel:
    def __init__(
        self,
        backend: Backend,
        *,
        capacity: int,
        flush_every_s: float,
        on_drop: Callable[[str, int], None] = lambda backend, n: None,
        hint: str = "",
    ) -> None:
        """`on_drop(backend name, n)`: count n dropped events (the Prometheus counter); `hint`: what to check,
        in the warning."""
        self.backend, self.flush_every_s, self.on_drop, self.hint = backend, flush_every_s, on_drop, hint
        self.dropped = 0
        self.written = 0
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max(1, capacity))
        self._warned = False
        self._closed = False
        self._finished = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"tracking-{backend.name}", daemon=True)
        self._thread.start()

    # --- the caller's side: never blocks ------------------------------------------------------------------
    def put(self, event: Event) -> None:
        if self._closed:
            return
        try:
            self._queue.put_nowait(event)
        except queue.Full:
            self._drop(1, "its queue is full: the backend is down or slower than the events come")

    def close(self, timeout: float, finished: bool = True) -> bool:
        """Flush and stop within `timeout` seconds; False if the backend did not finish in time."""
        if self._closed:
            return not self._thread.is_alive()
        self._closed, self._finished = True, finished
        deadline = time.monotonic() + timeout
        try:
            self._queue.put(_STOP, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if not self._thread.is_alive():
            return True
        left = self._queue.qsize()
        self._drop(left, f"it did not finish within {timeout:.0f}s of the end; {left} events left unwritten")
        return False

    # --- the drain thread ---------------------------------------------------------------------------------
    def _run(self) -> None:
        next_flush = time.monotonic() + self.flush_every_s
        while True:
            try:
                first = self._queue.get(timeout=max(0.0, next_flush - time.monotonic()))
            except queue.Empty:
                first = None
            batch, stop = [], first is _STOP
            if first is not None and not stop:
                batch.append(first)
                while len(batch) < BATCH:
                    try:
                        more = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if more is _STOP:
                        stop = True
                        break
                    batch.append(more)
            if batch:
                if self._call(lambda b=batch: self.backend.write(b), dropping=len(batch)):
                    self.written += len(batch)
            if stop:
                self._call(lambda: self.backend.close(self._finished))
                return
            if time.monotonic() >= next_flush:
                self._call(self.backend.flush)
                next_flush = time.monotonic() + self.flush_every_s

    def _call(self, fn: Callable[[], None], dropping: int = 0) -> bool:
        """`fn()`; False when it raised: then `dropping` events are counted as dropped (a failed flush or
        close drops nothing by itself: the backend keeps what it could not deliver)."""
        try:
            fn()
            return True
        except Exception as e:  # a backend's failure is counted and logged here, never raised into training
            self._drop(dropping, f"{type(e).__name__}: {e}")
            return False

    def _drop(self, n: int, why: str) -> None:
        with self._lock:
            self.dropped += n
            warn, self._warned = not self._warned, True
        if n:
            self.on_drop(self.backend.name, n)
        if warn:
            log.warning(
                "tracking: %s is not taking events (%s); training goes on, events it cannot take are dropped "
                "and counted in ddiloco_tracking_dropped_events_total{backend=%r}, without further warnings.%s",
                self.backend.name,
                why,
                self.backend.name,
                f" {self.hint}" if self.hint else "",
            )
        else:
            log.debug("tracking: %s: %d more events dropped (%s)", self.backend.name, n, why)

    @property
    def stats(self) -> Mapping[str, Any]:
        return {"written": self.written, "dropped": self.dropped, "queued": self._queue.qsize()}
