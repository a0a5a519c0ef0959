"""The Store protocol every backend implements, its errors, key rules and I/O counters.

Keys are '/'-separated relative paths over a small character set, valid as file paths, S3 object names and
metric labels. The public methods validate, prefix and count once; a backend implements only the raw
operations on full keys (`_put`, `_get`, `_get_range`, `_size`, `_exists`, `_list`, `_delete`, `_create`),
which makes `child()` a cheap shallow copy. `get_range` streams large objects in bounded memory; `list`
matches whole path segments. Errors a caller can act on are distinct types (`NotFound`, `StoreUnavailable`,
`StoreConfigError`, `ObjectTooLarge`). `create` is the one conditional write: write-once and atomic, how
racing processes claim something exactly once; claimants should write content unique to themselves, so a
create retried after an ambiguous failure can tell its own write by its bytes.

Design notes: docs/internals.md, "The protocol every backend implements".
"""

from __future__ import annotations

import abc
import copy
import dataclasses
import json
import logging
import operator
import re
import threading
from typing import Any

from ddiloco.store.blob import Blob, Data, Lend, as_bytes

logger = logging.getLogger(__name__)

__all__ = [
    "AtomicCreateUnsupported",
    "NotFound",
    "ObjectTooLarge",
    "Store",
    "StoreConfigError",
    "StoreError",
    "StoreStats",
    "StoreUnavailable",
    "TEMP_NAME_RE",
    "validate_key",
    "validate_prefix",
]


class StoreError(Exception):
    """Any failure of a store operation."""


class NotFound(StoreError):
    """The key does not exist."""


class StoreUnavailable(StoreError):
    """A transient failure persisted after all retries; the caller should carry on and try again later."""


class ObjectTooLarge(StoreError):
    """The object is larger than the caller's `max_bytes`; its body was not read."""


class StoreConfigError(StoreError):
    """Misconfiguration the user must fix (URL, credentials, bucket, permissions); the message says how."""


class AtomicCreateUnsupported(StoreConfigError):
    """`create` cannot be atomic here: raised for an S3 endpoint without conditional PUT only when the caller
    asked for `strict=True` (else a warned, racy fallback), and always for a file system without hard links
    (there is no safe fallback)."""


_SEGMENT_RE = re.compile(r"[A-Za-z0-9._=-]+")
# Temp files of FileStore (`.{name}.tmp-{pid}-{tid}-{hex}`); keys may not look like them so that listing
# can skip them without ever hiding a real key.
TEMP_NAME_RE = re.compile(r"\..*\.tmp-\d+-\d+-[0-9a-f]+")


def validate_key(key: str) -> str:
    """Return `key` if it is a valid store key, else raise ValueError saying what is wrong."""
    if not isinstance(key, str):
        raise ValueError(f"store key must be a str, got {type(key).__name__}: {key!r}")
    if not key:
        raise ValueError("store key must not be empty")
    if key.startswith("/"):
        raise ValueError(f"store key {key!r} must be relative (no leading '/')")
    for segment in key.split("/"):
        if segment in ("", ".", ".."):
            raise ValueError(f"store key {key!r} has an empty, '.' or '..' segment")
        if not _SEGMENT_RE.fullmatch(segment):
            raise ValueError(f"store key {key!r}: segment {segment!r} may only contain [A-Za-z0-9._=-]")
        if TEMP_NAME_RE.fullmatch(segment):
            raise ValueError(f"store key {key!r}: segment {segment!r} looks like a temp file name")
    return key


def validate_prefix(prefix: str) -> str:
    """Normalize a listing prefix: '' (everything) or a valid key, a trailing '/' allowed; returns it without '/'."""
    if prefix == "":
        return ""
    stripped = prefix[:-1] if prefix.endswith("/") else prefix
    validate_key(stripped)
    return stripped


@dataclasses.dataclass
class StoreStats:
    """Thread-safe I/O counters of a store and all its children."""

    bytes_written: int = 0
    bytes_read: int = 0
    puts: int = 0
    gets: int = 0
    lists: int = 0
    deletes: int = 0
    heads: int = 0
    creates: int = 0
    """create() calls, whatever their outcome (a successful one also counts in bytes_written)."""
    create_conflicts: int = 0
    """create() calls that found the key taken and returned False."""
    retries: int = 0
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **counts: int) -> None:
        with self._lock:
            for name, value in counts.items():
                setattr(self, name, getattr(self, name) + value)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {
                f.name: getattr(self, f.name) for f in dataclasses.fields(self) if not f.name.startswith("_")
            }


class Store(abc.ABC):
    """A flat key -> bytes namespace rooted at `url`; see the module docstring for the rules."""

    url: str
    stats: StoreStats

    def __init__(self, url: str, *, prefix: str = "", stats: StoreStats | None = None) -> None:
        self._prefix = validate_prefix(prefix)
        self.url = url
        self.stats = stats if stats is not None else StoreStats()

    # ---- raw backend operations on full keys (relative to the backend root, prefix already applied) ----

    @abc.abstractmethod
    def _put(self, full_key: str, data: Data) -> None: ...

    @abc.abstractmethod
    def _get(self, full_key: str, max_bytes: int | None) -> bytes:
        """Return the object; raise NotFound, or ObjectTooLarge before reading a body over max_bytes."""

    @abc.abstractmethod
    def _get_range(self, full_key: str, offset: int, length: int) -> bytes:
        """Bytes [offset, offset + length) of the object, fewer where it ends sooner (b"" at or past its
        end); NotFound if absent. Called with offset >= 0 and length >= 1."""

    @abc.abstractmethod
    def _size(self, full_key: str) -> int:
        """The object's size in bytes without reading it; NotFound if absent."""

    @abc.abstractmethod
    def _exists(self, full_key: str) -> bool: ...

    @abc.abstractmethod
    def _list(self, full_prefix: str) -> list[str]:
        """All full keys strictly under directory `full_prefix` ('' = everything), any order."""

    def _sizes(self, full_prefix: str) -> dict[str, int]:
        """Full key -> size in bytes of every object under `full_prefix`. This fallback reads each object;
        backends that can list sizes (file: stat, S3: the listing itself) override it."""
        out = {}
        for k in self._list(full_prefix):
            try:
                out[k] = len(self._get(k, None))
            except NotFound:  # deleted since the listing
                continue
        return out

    @abc.abstractmethod
    def _delete(self, full_key: str) -> None:
        """Delete the object; do nothing if it does not exist."""

    @abc.abstractmethod
    def _create(self, full_key: str, data: Data, strict: bool) -> bool:
        """Write the object only if the key is free, atomically; True if this call wrote it. `strict`: raise
        AtomicCreateUnsupported rather than fall back to a racy create where atomicity is impossible."""

    def check(self) -> None:
        """Fail fast with StoreConfigError if the store cannot be used (missing bucket, bad credentials...)."""
        return None  # nothing to check for in-process stores

    # ---- public API ----

    def _full(self, key: str) -> str:
        validate_key(key)
        return f"{self._prefix}/{key}" if self._prefix else key

    def _full_prefix(self, prefix: str) -> str:
        prefix = validate_prefix(prefix)
        return "/".join(p for p in (self._prefix, prefix) if p)

    def _relative(self, full_key: str) -> str:
        return full_key[len(self._prefix) + 1 :] if self._prefix else full_key

    def put(self, key: str, data: Data) -> None:
        """Write the object atomically: a reader sees the previous object, the whole new one, or nothing.
        `data`: bytes, or a `Blob` of buffers written in order without being joined (`ddiloco.store.blob`)."""
        data = _as_data("put", key, data)
        self._put(self._full(key), data)
        self.stats.add(puts=1, bytes_written=len(data))

    def create(self, key: str, data: Data, *, strict: bool = False) -> bool:
        """Write the object only if no object exists at `key`, atomically (write-once).

        Returns True if this call created it, False if the key was already taken (that object is left
        untouched). Of any number of racing callers, in threads or processes, exactly one gets True. Readers
        never see a partial object. Where the backend cannot do it atomically (an S3 endpoint that ignores
        `If-None-Match`), it logs one warning and falls back to a racy exists-then-put, or raises
        AtomicCreateUnsupported if `strict`. See the module docstring for retries (write unique content).
        A caller that retries create itself after StoreUnavailable should do the same: on False, compare
        `get(key)` with its own bytes, since the failed call may have created the object.
        """
        data = _as_data("create", key, data)
        created = self._create(self._full(key), data, strict)
        if created:
            self.stats.add(creates=1, bytes_written=len(data))
        else:
            self.stats.add(creates=1, create_conflicts=1)
        return created

    def _holds(self, full_key: str, data: Data) -> bool:
        """Whether the object at `full_key` is exactly `data`: how a backend settles a create it retried
        after an ambiguous failure and then found taken (identical bytes: it was that call's own write)."""
        try:
            existing = self._get(full_key, len(data))
        except (NotFound, ObjectTooLarge):
            return False
        if existing != as_bytes(data):
            return False
        logger.info(
            "create %s: a retried attempt found its own bytes there; counting it as created", full_key
        )
        return True

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        """Read the object; NotFound if absent, ObjectTooLarge (body unread) if larger than max_bytes."""
        full = self._full(key)
        self.stats.add(gets=1)
        data = self._get(full, max_bytes)
        self.stats.add(bytes_read=len(data))
        return data

    def get_into(self, key: str, lend: Lend, *, max_bytes: int | None = None) -> memoryview:
        """Read the object into memory the caller lends (`lend(size)`, a pooled buffer) and return the view
        of its bytes there; errors as `get`. Backends that know the size first read straight into it (file);
        the others read it and copy it in."""
        full = self._full(key)
        self.stats.add(gets=1)
        view = self._get_into(full, lend, max_bytes)
        self.stats.add(bytes_read=len(view))
        return view

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        """Read `length` bytes of the object from byte `offset`: NotFound if absent; a range reaching past
        the end gives the bytes that exist (b"" at or after the end), so a short result means the object
        ends there. Counted as a get; the memory used is the range's, whatever the object's size."""
        try:
            offset, length = operator.index(offset), operator.index(length)
        except TypeError:
            offset = length = -1
        if offset < 0 or length < 0:
            raise ValueError(f"get_range({key!r}): offset and length must be integers >= 0")
        full = self._full(key)
        self.stats.add(gets=1)
        if length == 0:
            if not self._exists(full):
                raise NotFound(f"no object {self.url}/{key}")
            return b""
        data = self._get_range(full, offset, length)
        self.stats.add(bytes_read=len(data))
        return data

    def size(self, key: str) -> int:
        """The object's size in bytes, without reading it (a stat, a HEAD); NotFound if absent."""
        full = self._full(key)
        self.stats.add(heads=1)
        return self._size(full)

    def _get_into(self, full_key: str, lend: Lend, max_bytes: int | None) -> memoryview:
        data = self._get(full_key, max_bytes)
        out = lend(len(data))[: len(data)]
        out[:] = data
        return out

    def exists(self, key: str) -> bool:
        full = self._full(key)
        self.stats.add(heads=1)
        return self._exists(full)

    def list(self, prefix: str = "") -> list[str]:
        """All keys under `prefix` (whole segments, recursive), relative to this store, sorted."""
        full_prefix = self._full_prefix(prefix)
        self.stats.add(lists=1)
        return sorted(self._relative(k) for k in self._list(full_prefix))

    def sizes(self, prefix: str = "") -> dict[str, int]:
        """Key -> size in bytes of every object under `prefix` (keys as `list` gives them): what the run
        summary reports as the store's size."""
        full_prefix = self._full_prefix(prefix)
        self.stats.add(lists=1)
        return {self._relative(k): n for k, n in sorted(self._sizes(full_prefix).items())}

    def delete(self, key: str) -> None:
        """Delete the object; deleting a missing key is not an error."""
        full = self._full(key)
        self.stats.add(deletes=1)
        self._delete(full)

    # ---- helpers ----

    def get_or_none(self, key: str, *, max_bytes: int | None = None) -> bytes | None:
        try:
            return self.get(key, max_bytes=max_bytes)
        except NotFound:
            return None

    def put_json(self, key: str, obj: Any) -> None:
        self.put(key, json.dumps(obj, ensure_ascii=False).encode("utf-8"))

    def create_json(self, key: str, obj: Any, *, strict: bool = False) -> bool:
        """`create` of a JSON document: True if this call created it, False if the key was taken."""
        return self.create(key, json.dumps(obj, ensure_ascii=False).encode("utf-8"), strict=strict)

    def get_json(self, key: str, *, max_bytes: int = 1 << 20) -> Any:
        """Read and parse a JSON object; NotFound if absent, StoreError naming the key if it is not JSON."""
        data = self.get(key, max_bytes=max_bytes)
        try:
            return json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise StoreError(f"corrupt JSON object {self.url}/{key}: {exc}") from exc

    def get_json_or_none(self, key: str, *, max_bytes: int = 1 << 20) -> Any | None:
        try:
            return self.get_json(key, max_bytes=max_bytes)
        except NotFound:
            return None

    def delete_prefix(self, prefix: str) -> int:
        """Delete every key under `prefix` ('' = everything in this store); return how many were deleted."""
        keys = self.list(prefix)
        for key in keys:
            self.delete(key)
        return len(keys)

    def child(self, prefix: str) -> Store:
        """A store rooted at `{url}/{prefix}`: same backend, same connection, same stats."""
        prefix = validate_prefix(prefix)
        if not prefix:
            raise ValueError("child() needs a non-empty prefix")
        clone = copy.copy(self)
        clone._prefix = "/".join(p for p in (self._prefix, prefix) if p)
        clone.url = f"{self.url}/{prefix}"
        return clone

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"


def _as_data(op: str, key: str, data: object) -> Data:
    if isinstance(data, Blob):
        return data
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"store {op}({key!r}) needs bytes or a Blob, got {type(data).__name__}")
    return bytes(data)
