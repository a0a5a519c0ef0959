"""A daemon thread that fetches a loader's chunks in cursor order ahead of use, at most `limit` alive.

Design choices:
- The thread takes a permit before each fetch and the consumer gives one back when it has finished a
  chunk, so at most `limit` chunks (the consumer's and those fetched ahead) exist at any time; the queue
  needs no bound of its own.
- It holds no reference to the loader (only a read function and an order function), so a loader dropped
  without close() can be collected and its finalizer stops the thread.
- A failed fetch is put on the queue in place of a chunk and ends the thread: `take` raises it in the
  consumer's thread, which decides whether to start another.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["ReadAhead", "memo"]


class ReadAhead:
    """A daemon thread fetching chunk positions (epoch, pos), pos, ... in order; at most `limit` alive."""

    def __init__(
        self,
        read: Callable[[int], np.ndarray],
        order: Callable[[int], np.ndarray],
        start: tuple[int, int],
        limit: int,
    ) -> None:
        self._read, self._order = read, order
        self._permits = threading.Semaphore(limit)
        self._queue: queue.SimpleQueue[tuple[int, int, np.ndarray] | BaseException] = queue.SimpleQueue()
        self._stop = threading.Event()
        self.fetched = 0
        self.released = 0
        self._thread = threading.Thread(target=self._run, args=start, name="token-read-ahead", daemon=True)
        self._thread.start()

    def _run(self, epoch: int, pos: int) -> None:
        try:
            while True:
                self._permits.acquire()
                if self._stop.is_set():
                    return
                order = self._order(epoch)
                chunk = self._read(int(order[pos]))
                self.fetched += 1
                self._queue.put((epoch, pos, chunk))
                epoch, pos = (epoch, pos + 1) if pos + 1 < len(order) else (epoch + 1, 0)
        except BaseException as exc:  # handed to the consumer, which raises it
            self._queue.put(exc)

    def take(self) -> tuple[int, int, np.ndarray]:
        item = self._queue.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def release(self) -> None:
        """The consumer is done with one chunk: the thread may fetch another."""
        self.released += 1
        self._permits.release()

    def close(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._permits.release()  # wake the thread if it waits for a permit
        self._thread.join(timeout)


def memo(order: Callable[[int], np.ndarray]) -> Callable[[int], np.ndarray]:
    """`order` remembering its last epoch (the read-ahead thread's own cache)."""
    last: list[Any] = [None, None]

    def cached(epoch: int) -> np.ndarray:
        if last[0] != epoch:
            last[:] = [epoch, order(epoch)]
        return last[1]

    return cached
