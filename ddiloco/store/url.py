"""Store URLs: `open_store(url)` picks the backend a URL names and checks the URL.

memory://NAME[/prefix]     in-process (tests, single-process runs)
file:///abs/dir            a directory, shared by processes on one machine or a shared volume;
                           a plain path (absolute or relative) means the same
s3://bucket[/prefix]       any S3 endpoint (MinIO, SeaweedFS, AWS); settings from DDILOCO_S3_* env vars

Design choices:
- The S3 backend is imported only for an s3:// URL: minio and urllib3 stay out of processes that never
  touch S3.
- A URL's prefix is checked like a key (`validate_key`), so a bad prefix fails at open, not at first use.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import unquote, urlsplit

from ddiloco.store.base import Store, StoreConfigError, validate_key
from ddiloco.store.file import FileStore
from ddiloco.store.memory import MemoryStore
from ddiloco.store.retry import RetryPolicy

__all__ = ["open_store"]

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
