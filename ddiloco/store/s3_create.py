"""Write-once objects on S3 (`S3Store.create`): a PUT with `If-None-Match: *`, probed once per connection.

A conditional single-part PUT is atomic on SeaweedFS 4.48 and AWS S3 (a taken key answers 412, 409 is
retried as transient), so create never goes multipart, whatever the size. minio cannot send the header
through `put_object`, so the PUT goes through `Minio._put_object` (minio is pinned exactly;
tests/unit/test_store_create.py guards that signature). An endpoint may ignore the header and overwrite,
so the first create on a connection probes `_probe/create-<random>` twice; without support, creates are
best-effort with one warning, or `AtomicCreateUnsupported` with `strict=True`. A retried create that meets
412 compares the stored bytes with its own (`Store._holds`).

Design notes (what was verified against SeaweedFS, the probe, retries): docs/internals.md, "S3",
"Write-once objects".
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, TypeVar

from minio import Minio
from minio.error import InvalidResponseError, S3Error

from ddiloco.store.base import AtomicCreateUnsupported, StoreConfigError, StoreError, StoreUnavailable
from ddiloco.store.blob import Data
from ddiloco.store.s3_io import body_of

logger = logging.getLogger(__name__)

__all__ = ["CreateSupport", "S3CreateMixin", "put_if_absent"]

T = TypeVar("T")

PROBE_PREFIX = "_probe"


def _precondition_failed(exc: BaseException) -> bool:
    if isinstance(exc, S3Error):
        status = exc.response.status if exc.response is not None else None
        return exc.code == "PreconditionFailed" or status == 412
    return isinstance(exc, InvalidResponseError) and getattr(exc, "_code", None) == 412  # 412 without XML


def put_if_absent(client: Minio, bucket: str, name: str, data: Data) -> bool:
    """One conditional PUT: True if it wrote the object, False on 412 (the key is taken). The body goes as
    `s3_io.body_of` makes it (a big one: its parts, unhashed)."""
    headers = {"If-None-Match": "*", "Content-Type": "application/octet-stream"}  # minio adds to it: fresh
    try:
        client._put_object(bucket, name, body_of(data), headers)
    except (S3Error, InvalidResponseError) as exc:
        if _precondition_failed(exc):
            return False
        raise
    return True


@dataclasses.dataclass
class CreateSupport:
    """Whether the endpoint honours `If-None-Match: *` on PUT: None until probed (per connection)."""

    atomic: bool | None = None
    reason: str = ""
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


class CreateConnection(Protocol):
    """What creating needs of an S3Store's connection (s3.py's `_Connection` has it): declared here, so this
    module does not import s3.py, which imports it."""

    client: Minio
    bucket: str
    root_prefix: str
    create: CreateSupport


class S3CreateMixin:
    """`_create` for S3Store; uses its connection, retry wrapper (`_call`) and raw operations."""

    _conn: CreateConnection
    url: str

    if TYPE_CHECKING:

        @property
        def _endpoint(self) -> str: ...
        def _call(self, what: str, fn: Callable[[], T], *, check_bucket: bool = True) -> T: ...
        def _put(self, full_key: str, data: Data) -> None: ...
        def _exists(self, full_key: str) -> bool: ...
        def _holds(self, full_key: str, data: Data) -> bool: ...

    def _create(self, full_key: str, data: Data, strict: bool) -> bool:
        if not self._atomic_create():
            if strict:
                raise AtomicCreateUnsupported(
                    f"S3 endpoint {self._endpoint} cannot create s3://{self._conn.bucket}/{full_key} "
                    f"atomically ({self._conn.create.reason}): use an endpoint that honours If-None-Match: * "
                    f"on PUT (AWS S3, a recent MinIO, SeaweedFS 4.48 is verified)"
                )
            return self._create_racy(full_key, data)
        conn = self._conn
        attempts = 0

        def once() -> bool:
            nonlocal attempts
            attempts += 1
            return put_if_absent(conn.client, conn.bucket, full_key, data)

        created = self._call(f"create {full_key}", once)
        return created or (attempts > 1 and self._holds(full_key, data))

    def _create_racy(self, full_key: str, data: Data) -> bool:
        """Best effort for endpoints without conditional PUT: NOT atomic (a racer may slip in between)."""
        if self._exists(full_key):
            return False
        self._put(full_key, data)
        return True

    def _atomic_create(self) -> bool:
        support = self._conn.create
        if support.atomic is not None:
            return support.atomic
        with support.lock:
            if support.atomic is None:
                support.reason = self._probe_create()
                support.atomic = not support.reason
                if support.atomic:
                    logger.info("S3 endpoint %s honours If-None-Match: * (atomic create)", self._endpoint)
                else:
                    logger.warning(
                        "S3 endpoint %s does not support conditional PUT (If-None-Match: *): %s. "
                        "Store.create on %s falls back to a racy exists-then-put: two processes creating "
                        "the same key at once may both believe they created it",
                        self._endpoint,
                        support.reason,
                        self.url,
                    )
            return support.atomic

    def _probe_create(self) -> str:
        """Create a probe object twice; return why creates are not atomic here, '' if they are."""
        conn = self._conn
        name = "/".join(p for p in (conn.root_prefix, PROBE_PREFIX, f"create-{uuid.uuid4().hex}") if p)
        probe, wrote = f"create probe s3://{conn.bucket}/{name}", False
        try:
            self._call(probe, lambda: put_if_absent(conn.client, conn.bucket, name, b"first"))
            wrote = True
            second = self._call(probe, lambda: put_if_absent(conn.client, conn.bucket, name, b"second"))
        except (StoreConfigError, StoreUnavailable):
            raise  # no answer about the feature: cache nothing
        except StoreError as exc:
            return f"it refused a conditional PUT: {exc}"
        finally:
            if wrote:
                self._delete_probe(name)
        return "it overwrote an existing object despite If-None-Match: *" if second else ""

    def _delete_probe(self, name: str) -> None:
        conn = self._conn
        try:
            self._call("delete create probe", lambda: conn.client.remove_object(conn.bucket, name))
        except StoreError as exc:
            logger.warning("could not delete the create probe s3://%s/%s: %s", conn.bucket, name, exc)
