"""Object stores: one protocol (`Store`), three backends, chosen by URL.

memory://NAME[/prefix]     in-process (tests, single-process runs)
file:///abs/dir            a directory, shared by processes on one machine or a shared volume;
                           a plain path (absolute or relative) means the same
s3://bucket[/prefix]       any S3 endpoint (MinIO, SeaweedFS, AWS); settings from DDILOCO_S3_* env vars

Every store has `create(key, data) -> bool`, an atomic write-once (see base.Store.create).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import unquote, urlsplit

from ddiloco.store.base import (
    AtomicCreateUnsupported,
    NotFound,
    ObjectTooLarge,
    Store,
    StoreConfigError,
    StoreError,
    StoreStats,
    StoreUnavailable,
    validate_key,
)
from ddiloco.store.file import FileStore
from ddiloco.store.memory import MemoryStore, reset_memory_stores
from ddiloco.store.retry import RetryPolicy, call_with_retry

logger = logging.getLogger(__name__)

__all__ = [
    "AtomicCreateUnsupported",
    "FileStore",
    "MemoryStore",
    "NotFound",
    "ObjectTooLarge",
    "RetryPolicy",
    "Store",
    "StoreConfigError",
    "StoreError",
    "StoreStats",
    "StoreUnavailable",
    "call_with_retry",
    "open_store",
    "reset_memory_stores",
    "validate_key",
]

_SUPPORTED = "memory://NAME[/prefix], file:///abs/dir (or a plain path), s3://bucket[/prefix]"


def _url_prefix(url: str, path: str) -> str:
    prefix = unquote(path).strip("/")
    if prefix:
        try:
            validate_key(prefix)
        except ValueError as exc:
            raise StoreConfigError(f"bad store URL {url!r}: {exc}") from exc
    return prefix


def open_store(url: str, *, retry: RetryPolicy | None = None, env: Mapping[str, str] | None = None) -> Store:
    """Open the store a URL names. `retry` governs transient failures (file and s3); `env` replaces
    os.environ for the S3 settings (tests)."""
    if not url or not url.strip():
        raise StoreConfigError(f"empty store URL: use one of {_SUPPORTED}")
    url = url.strip()
    if "://" not in url:
        return FileStore(Path(url).expanduser().resolve(), retry=retry)

    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if parts.query or parts.fragment:
        raise StoreConfigError(f"bad store URL {url!r}: no '?' or '#' parts allowed")
    if scheme == "memory":
        name = parts.netloc
        if not name or "/" in name:
            raise StoreConfigError(f"bad store URL {url!r}: use memory://NAME[/prefix]")
        try:
            validate_key(name)
        except ValueError as exc:
            raise StoreConfigError(f"bad store URL {url!r}: {exc}") from exc
        return MemoryStore(name, _url_prefix(url, parts.path))
    if scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise StoreConfigError(
                f"bad store URL {url!r}: a file URL needs an absolute path, file:///abs/dir (three slashes)"
            )
        path = unquote(parts.path)
        if not path.startswith("/"):
            raise StoreConfigError(f"bad store URL {url!r}: use file:///abs/dir")
        return FileStore(Path(os.path.normpath(path)), retry=retry)
    if scheme == "s3":
        from ddiloco.store.s3 import S3Store  # imports minio/urllib3 only when needed

        if not parts.netloc:
            raise StoreConfigError(f"bad store URL {url!r}: use s3://bucket[/prefix]")
        return S3Store.from_env(parts.netloc, _url_prefix(url, parts.path), retry=retry, env=env)
    raise StoreConfigError(f"unsupported store URL scheme {parts.scheme!r} in {url!r}: use {_SUPPORTED}")
