"""In-process store for tests and single-process runs: `memory://NAME[/prefix]`.

Stores with the same NAME share one namespace (a process-global registry), so code that opens the store by
URL twice sees the same data, as it would with a directory or a bucket. Like a file store, a key cannot be
both an object and a "directory" of other keys (`a/b` and `a/b/c`): the memory store refuses it too, so a
test on memory:// cannot pass with a layout the file store would reject.
"""

from __future__ import annotations

import collections
import logging
import threading

from ddiloco.store.base import NotFound, ObjectTooLarge, Store, StoreError, StoreStats
from ddiloco.store.blob import Data, as_bytes

logger = logging.getLogger(__name__)

__all__ = ["MemoryStore", "reset_memory_stores"]


class _Namespace:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.objects: dict[str, bytes] = {}
        self.dirs: collections.Counter[str] = collections.Counter()  # directory -> number of keys below it
        self.stats = StoreStats()


_REGISTRY: dict[str, _Namespace] = {}
_REGISTRY_LOCK = threading.Lock()


def _namespace(name: str) -> _Namespace:
    with _REGISTRY_LOCK:
        ns = _REGISTRY.get(name)
        if ns is None:
            ns = _REGISTRY[name] = _Namespace()
        return ns


def reset_memory_stores() -> None:
    """Forget every memory store of this process (for tests)."""
    with _REGISTRY_LOCK:
        _REGISTRY.clear()


def _parents(key: str) -> list[str]:
    parts = key.split("/")
    return ["/".join(parts[:i]) for i in range(1, len(parts))]


class MemoryStore(Store):
    """A named in-process namespace; thread-safe; stores with the same name share data and stats."""

    def __init__(self, name: str, prefix: str = "") -> None:
        ns = _namespace(name)
        url = f"memory://{name}" + (f"/{prefix.strip('/')}" if prefix.strip("/") else "")
        super().__init__(url, prefix=prefix, stats=ns.stats)
        self.name = name
        self._ns = ns

    def _where(self, full_key: str) -> str:
        return f"memory://{self.name}/{full_key}"

    def _put(self, full_key: str, data: Data) -> None:
        with self._ns.lock:
            self._put_locked(full_key, data)

    def _create(self, full_key: str, data: Data, strict: bool) -> bool:
        with self._ns.lock:  # the check and the write are one step for every store of this namespace
            if full_key in self._ns.objects:
                return False
            self._put_locked(full_key, data)
            return True

    def _put_locked(self, full_key: str, data: Data) -> None:
        ns = self._ns
        if ns.dirs.get(full_key):
            raise StoreError(f"cannot put {self._where(full_key)}: it is a prefix of other keys")
        for parent in _parents(full_key):
            if parent in ns.objects:
                raise StoreError(f"cannot put {self._where(full_key)}: its parent {parent!r} is an object")
        if full_key not in ns.objects:
            for parent in _parents(full_key):
                ns.dirs[parent] += 1
        ns.objects[full_key] = as_bytes(data)  # a Blob's buffers are borrowed: keep a copy

    def _get(self, full_key: str, max_bytes: int | None) -> bytes:
        with self._ns.lock:
            data = self._ns.objects.get(full_key)
        if data is None:
            raise NotFound(f"no object {self._where(full_key)}")
        if max_bytes is not None and len(data) > max_bytes:
            raise ObjectTooLarge(
                f"object {self._where(full_key)} has {len(data)} bytes > max_bytes {max_bytes}"
            )
        return data

    def _get_range(self, full_key: str, offset: int, length: int) -> bytes:
        with self._ns.lock:
            data = self._ns.objects.get(full_key)
        if data is None:
            raise NotFound(f"no object {self._where(full_key)}")
        return data[offset : offset + length]

    def _size(self, full_key: str) -> int:
        with self._ns.lock:
            data = self._ns.objects.get(full_key)
        if data is None:
            raise NotFound(f"no object {self._where(full_key)}")
        return len(data)

    def _exists(self, full_key: str) -> bool:
        with self._ns.lock:
            return full_key in self._ns.objects

    def _list(self, full_prefix: str) -> list[str]:
        start = f"{full_prefix}/" if full_prefix else ""
        with self._ns.lock:
            return [k for k in self._ns.objects if k.startswith(start)]

    def _sizes(self, full_prefix: str) -> dict[str, int]:
        start = f"{full_prefix}/" if full_prefix else ""
        with self._ns.lock:
            return {k: len(v) for k, v in self._ns.objects.items() if k.startswith(start)}

    def _delete(self, full_key: str) -> None:
        ns = self._ns
        with ns.lock:
            if ns.objects.pop(full_key, None) is None:
                return
            for parent in _parents(full_key):
                ns.dirs[parent] -= 1
                if not ns.dirs[parent]:
                    del ns.dirs[parent]
