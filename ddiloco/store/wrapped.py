"""Stores that wrap another store: the base for fault injection and link shaping.

A wrapper shares the inner store's URL and stats and delegates the raw backend operations, so a wrapped
store behaves exactly like the inner one unless the wrapper decides otherwise. Counting happens once, in the
outer store's public method (the inner store's raw operations do not count).

`create` passes straight through to the inner backend, which owns the atomicity and settles its own
ambiguous retries. A wrapper that refuses an operation (OutageStore) does so before calling the inner store,
so a refused create has certainly not happened: it raises, and never turns into a wrong False.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from ddiloco.store.base import Store, StoreUnavailable
from ddiloco.store.blob import Data


class DelegatingStore(Store):
    def __init__(self, inner: Store) -> None:
        super().__init__(inner.url, stats=inner.stats)
        self.inner = inner

    def before(self, op: str, key: str) -> None:
        """Hook called before every raw operation."""

    def _put(self, full_key: str, data: Data) -> None:
        self.before("put", full_key)
        self.inner._put(self.inner._full(full_key), data)

    def _get(self, full_key: str, max_bytes: int | None) -> bytes:
        self.before("get", full_key)
        return self.inner._get(self.inner._full(full_key), max_bytes)

    def _get_range(self, full_key: str, offset: int, length: int) -> bytes:
        self.before("get", full_key)
        return self.inner._get_range(self.inner._full(full_key), offset, length)

    def _size(self, full_key: str) -> int:
        self.before("exists", full_key)
        return self.inner._size(self.inner._full(full_key))

    def _exists(self, full_key: str) -> bool:
        self.before("exists", full_key)
        return self.inner._exists(self.inner._full(full_key))

    def _list(self, full_prefix: str) -> list[str]:
        self.before("list", full_prefix)
        return [self.inner._relative(k) for k in self.inner._list(self.inner._full_prefix(full_prefix))]

    def _sizes(self, full_prefix: str) -> dict[str, int]:
        self.before("list", full_prefix)
        sizes = self.inner._sizes(self.inner._full_prefix(full_prefix))
        return {self.inner._relative(k): n for k, n in sizes.items()}

    def _delete(self, full_key: str) -> None:
        self.before("delete", full_key)
        self.inner._delete(self.inner._full(full_key))

    def _create(self, full_key: str, data: Data, strict: bool) -> bool:
        self.before("create", full_key)
        return self.inner._create(self.inner._full(full_key), data, strict)


class OutageStore(DelegatingStore):
    """Raises StoreUnavailable for every operation inside the given wall-clock windows (chaos: store outage)."""

    def __init__(
        self, inner: Store, windows: Sequence[tuple[float, float]], clock: Callable[[], float] = time.time
    ) -> None:
        super().__init__(inner)
        self.windows = list(windows)
        self.clock = clock
        self.refused = 0

    def before(self, op: str, key: str) -> None:
        now = self.clock()
        for start, end in self.windows:
            if start <= now < end:
                self.refused += 1
                raise StoreUnavailable(
                    f"store unavailable (injected outage until {end - now:.1f}s from now): {op} {key}"
                )
