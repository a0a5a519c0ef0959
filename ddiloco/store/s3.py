"""S3 store over the minio SDK: `s3://bucket[/prefix]`, endpoint and credentials from the environment.

Our `RetryPolicy` is the only retry layer (urllib3 without retries, short timeouts), so a dead endpoint is
`StoreUnavailable` within the policy's deadline. Objects up to 5 GiB go up in one PUT; `get(max_bytes=...)`
checks Content-Length before reading a body. The bucket is checked once, lazily, so missing buckets and
rejected credentials are one `StoreConfigError`. The client always knows its region (`DDILOCO_S3_REGION`,
`AWS_REGION`, else us-east-1 off AWS; `auto` asks the bucket), so it never sends the bucket-level read a
Kubeflow profile's key may not make; every call made here is one a profile's policy grants inside its
prefixes (tests/integration/test_s3_profile_identity.py). `create` lives in s3_create.py, bodies in
s3_io.py, credentials without static keys in s3_credentials.py.

Design notes (transient errors, regions): docs/internals.md, "S3".
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import certifi
import urllib3
from minio import Minio
from minio.deleteobjects import DeleteObject
from minio.error import InvalidResponseError, MinioException, S3Error, ServerError
from minio.helpers import MAX_PART_SIZE, check_bucket_name

from ddiloco.store.base import NotFound, ObjectTooLarge, Store, StoreConfigError, StoreError, validate_key
from ddiloco.store.blob import Data, Lend, reader_of
from ddiloco.store.retry import RetryPolicy, call_with_retry
from ddiloco.store.s3_create import CreateSupport, S3CreateMixin
from ddiloco.store.s3_credentials import ChainProvider
from ddiloco.store.s3_io import Client, body_of, read_into
from ddiloco.store.s3_settings import AUTO_REGION, S3Settings, bad_endpoint

logger = logging.getLogger(__name__)

__all__ = ["S3Settings", "S3Store"]

T = TypeVar("T")

_TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "RequestTimeout",
        "InternalError",
        "ServiceUnavailable",
        "OperationAborted",
        "XMinioServerNotInitialized",
        "ConditionalRequestConflict",  # 409 on AWS: a conflicting conditional write is in flight
    }
)
_AUTH_CODES = frozenset(
    {
        "AccessDenied",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "AllAccessDisabled",
        "InvalidToken",
        "ExpiredToken",
        "AuthorizationHeaderMalformed",
    }
)
_DELETE_BATCH = 1000  # DeleteObjects limit
_PUT_HEADERS = {"Content-Type": "application/octet-stream"}


def _status(exc: BaseException) -> int | None:
    if isinstance(exc, S3Error):
        return exc.response.status if exc.response is not None else None
    if isinstance(exc, ServerError):
        return exc.status_code
    if isinstance(exc, InvalidResponseError):
        return getattr(exc, "_code", None)
    return None


def is_transient(exc: BaseException) -> bool:
    """Whether a failed S3 call is worth retrying."""
    if isinstance(exc, (urllib3.exceptions.SSLError, urllib3.exceptions.LocationValueError)):
        return False  # certificate problems and unparsable hosts do not fix themselves
    if isinstance(exc, (urllib3.exceptions.HTTPError, ConnectionError, TimeoutError)):
        return True
    if isinstance(exc, S3Error) and exc.code in _TRANSIENT_CODES:
        return True
    status = _status(exc)
    return status is not None and ((status >= 500 and status != 501) or status == 429)


@dataclasses.dataclass
class _Connection:
    """State shared by an S3Store and its children."""

    client: Minio
    http: urllib3.PoolManager
    settings: S3Settings
    bucket: str
    root_prefix: str = ""
    """The store URL's prefix (children add to theirs, not to this)."""
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    bucket_ok: bool = False
    create: CreateSupport = dataclasses.field(default_factory=CreateSupport)


class S3Store(S3CreateMixin, Store):
    """Objects in `bucket` under an optional prefix, over any S3-compatible endpoint."""

    def __init__(
        self, bucket: str, prefix: str = "", *, settings: S3Settings, retry: RetryPolicy | None = None
    ) -> None:
        try:
            check_bucket_name(bucket)
        except ValueError as exc:
            raise StoreConfigError(f"invalid S3 bucket name {bucket!r} in the store URL: {exc}") from exc
        prefix = prefix.strip("/")
        super().__init__(f"s3://{bucket}" + (f"/{prefix}" if prefix else ""), prefix=prefix)
        http = urllib3.PoolManager(
            timeout=urllib3.Timeout(connect=settings.connect_timeout, read=settings.read_timeout),
            maxsize=16,
            cert_reqs="CERT_REQUIRED",
            ca_certs=settings.ca_bundle or os.environ.get("SSL_CERT_FILE") or certifi.where(),
            retries=False,
        )
        try:
            keys: dict[str, Any] = {
                "access_key": settings.access_key,
                "secret_key": settings.secret_key,
                "session_token": settings.session_token,
            }
            if settings.chain_env is not None:  # no static keys: the AWS chain (s3_credentials)
                source = settings.credentials_from.removeprefix("the AWS credential chain: ")
                keys = {"credentials": ChainProvider(settings.chain_env, source)}
            client = Client(
                settings.endpoint,
                secure=settings.secure,
                region=settings.client_region,
                http_client=http,
                **keys,
            )
        except ValueError as exc:
            raise bad_endpoint(settings.endpoint, str(exc)) from exc
        self._conn = _Connection(
            client=client, http=http, settings=settings, bucket=bucket, root_prefix=self._prefix
        )
        self._retry = retry if retry is not None else RetryPolicy()

    @classmethod
    def from_env(
        cls,
        bucket: str,
        prefix: str = "",
        *,
        retry: RetryPolicy | None = None,
        env: Mapping[str, str] | None = None,
    ) -> S3Store:
        return cls(bucket, prefix, settings=S3Settings.from_env(env), retry=retry)

    @property
    def bucket(self) -> str:
        return self._conn.bucket

    # ---- plumbing ----

    def _call(self, what: str, fn: Callable[[], T], *, check_bucket: bool = True) -> T:
        """Run one S3 operation under the retry policy and translate its errors."""
        if check_bucket:
            self.check()

        def on_retry(attempt: int, exc: BaseException, delay: float) -> None:
            self.stats.add(retries=1)
            logger.warning("S3 %s on %s: %s; retry %d in %.2fs", what, self._endpoint, exc, attempt, delay)

        try:
            return call_with_retry(
                fn,
                self._retry,
                is_transient=is_transient,
                on_retry=on_retry,
                what=f"S3 {what} on {self._endpoint}",
            )
        except S3Error as exc:
            raise self._translate(exc, what) from exc
        except urllib3.exceptions.SSLError as exc:
            raise StoreConfigError(
                f"TLS to {self._endpoint} failed ({exc}): set DDILOCO_S3_CA_BUNDLE to the CA certificate "
                f"or fix DDILOCO_S3_ENDPOINT's scheme"
            ) from exc
        except urllib3.exceptions.LocationValueError as exc:
            raise bad_endpoint(self._conn.settings.endpoint, str(exc)) from exc
        except MinioException as exc:
            raise StoreError(f"S3 {what} on {self._endpoint} failed: {exc}") from exc

    @property
    def _endpoint(self) -> str:
        return self._conn.settings.endpoint_url

    def _translate(self, exc: S3Error, what: str) -> StoreError:
        bucket = self._conn.bucket
        if exc.code == "NoSuchBucket":
            return self._missing_bucket()
        if exc.code == "AuthorizationHeaderMalformed":
            return StoreConfigError(
                f"S3 {self._endpoint} refused {what} on bucket '{bucket}': {exc.message} Set "
                f"DDILOCO_S3_REGION to the bucket's region (or to '{AUTO_REGION}' to ask the bucket)"
            )
        if exc.code in _AUTH_CODES:
            source = self._conn.settings.credentials_from
            return StoreConfigError(
                f"S3 {self._endpoint} refused {what} on bucket '{bucket}' ({exc.code}) with the key from "
                f"{source}: set DDILOCO_S3_ACCESS_KEY / DDILOCO_S3_SECRET_KEY to a key with read/write "
                f"access to the bucket under the store's prefix (a Kubeflow profile's key may use only its "
                f"namespace's prefixes, e.g. s3://mlpipeline/private/<namespace>/...)"
            )
        return StoreError(f"S3 {what} on {self._endpoint}/{bucket} failed: {exc.code}: {exc.message}")

    def _missing_bucket(self) -> StoreConfigError:
        bucket = self._conn.bucket
        return StoreConfigError(
            f"bucket '{bucket}' does not exist on {self._endpoint}: create it (mc mb ALIAS/{bucket}) "
            f"or set --store to an existing bucket"
        )

    def check(self) -> None:
        """Verify once (shared with children) that the bucket exists and the credentials are accepted."""
        conn = self._conn
        if conn.bucket_ok:
            return
        with conn.lock:
            if conn.bucket_ok:
                return
            if not self._call(
                "bucket check", lambda: conn.client.bucket_exists(conn.bucket), check_bucket=False
            ):
                raise self._missing_bucket()
            conn.bucket_ok = True

    # ---- raw operations ----

    def _put(self, full_key: str, data: Data) -> None:
        conn = self._conn

        def once() -> None:
            if len(data) <= MAX_PART_SIZE:  # one PUT of the parts as they are (s3_io)
                conn.client._put_object(conn.bucket, full_key, body_of(data), dict(_PUT_HEADERS))
            else:
                conn.client.put_object(
                    conn.bucket, full_key, reader_of(data), len(data), part_size=MAX_PART_SIZE
                )

        self._call(f"put {full_key}", once)

    def _open(self, full_key: str, offset: int = 0, length: int = 0) -> urllib3.BaseHTTPResponse:
        """GET the object (the byte range when length > 0); NotFound if absent."""
        conn = self._conn
        try:
            return conn.client.get_object(conn.bucket, full_key, offset=offset, length=length)
        except S3Error as exc:
            if exc.code == "NoSuchKey":
                raise NotFound(f"no object s3://{conn.bucket}/{full_key}") from exc
            raise

    def _get(self, full_key: str, max_bytes: int | None) -> bytes:
        return self._read(full_key, lambda resp, where: _read_body(resp, max_bytes, where))

    def _get_into(self, full_key: str, lend: Lend, max_bytes: int | None) -> memoryview:
        def body(resp: urllib3.BaseHTTPResponse, where: str) -> memoryview:
            if resp.headers.get("Content-Length") is not None:
                return read_into(resp, lend, max_bytes, where)
            data = _read_body(resp, max_bytes, where)  # no length to lend for: read, then copy
            out = lend(len(data))[: len(data)]
            out[:] = data
            return out

        return self._read(full_key, body)

    def _read(self, full_key: str, body: Callable[[urllib3.BaseHTTPResponse, str], T]) -> T:
        """One GET of the whole object, its body read by `body(response, where)`, under the retry policy."""

        def once() -> T:
            resp = self._open(full_key)
            try:
                return body(resp, f"s3://{self._conn.bucket}/{full_key}")
            finally:
                resp.close()
                resp.release_conn()

        return self._call(f"get {full_key}", once)

    def _get_range(self, full_key: str, offset: int, length: int) -> bytes:
        def once() -> bytes:
            try:
                resp = self._open(full_key, offset, length)
            except S3Error as exc:
                if exc.code == "InvalidRange":  # 416: the range starts at or after the end
                    return b""
                raise
            try:
                return resp.read(length)  # at most the range, whatever the server sends
            finally:
                resp.close()
                resp.release_conn()

        return self._call(f"get {full_key} [{offset}, +{length})", once)

    def _stat(self, full_key: str) -> int | None:
        """The object's size, None if absent (one HEAD)."""
        conn = self._conn

        def once() -> int | None:
            try:
                return conn.client.stat_object(conn.bucket, full_key).size or 0
            except S3Error as exc:
                if exc.code in ("NoSuchKey", "NoSuchObject"):
                    return None
                raise

        return self._call(f"stat {full_key}", once)

    def _size(self, full_key: str) -> int:
        size = self._stat(full_key)
        if size is None:
            raise NotFound(f"no object s3://{self._conn.bucket}/{full_key}")
        return size

    def _exists(self, full_key: str) -> bool:
        return self._stat(full_key) is not None

    def _list(self, full_prefix: str) -> list[str]:
        conn = self._conn
        s3_prefix = f"{full_prefix}/" if full_prefix else ""

        def once() -> list[str]:
            names = (
                o.object_name for o in conn.client.list_objects(conn.bucket, prefix=s3_prefix, recursive=True)
            )
            return [n for n in names if n is not None and _is_key(n)]

        return self._call(f"list {s3_prefix or '/'}", once)

    def _sizes(self, full_prefix: str) -> dict[str, int]:
        conn = self._conn
        s3_prefix = f"{full_prefix}/" if full_prefix else ""

        def once() -> dict[str, int]:
            listing = conn.client.list_objects(conn.bucket, prefix=s3_prefix, recursive=True)
            return {o.object_name: o.size or 0 for o in listing if o.object_name and _is_key(o.object_name)}

        return self._call(f"list {s3_prefix or '/'}", once)

    def _delete(self, full_key: str) -> None:
        conn = self._conn
        self._call(f"delete {full_key}", lambda: conn.client.remove_object(conn.bucket, full_key))

    def delete_prefix(self, prefix: str) -> int:
        """Delete every key under `prefix` with batched DeleteObjects calls; return how many."""
        keys = self.list(prefix)
        full_keys = [self._full(k) for k in keys]
        conn = self._conn
        for start in range(0, len(full_keys), _DELETE_BATCH):
            batch = full_keys[start : start + _DELETE_BATCH]

            def once(batch: list[str] = batch) -> None:
                errors = list(conn.client.remove_objects(conn.bucket, [DeleteObject(k) for k in batch]))
                if errors:
                    first = errors[0]
                    raise StoreError(
                        f"S3 delete of {len(errors)} object(s) under {self.url}/{prefix} failed, first: "
                        f"{first.name}: {first.code} {first.message}"
                    )

            self._call(f"delete {len(batch)} objects", once)
        self.stats.add(deletes=len(keys))
        return len(keys)


def _read_body(resp: urllib3.BaseHTTPResponse, max_bytes: int | None, where: str) -> bytes:
    """A GET's body; ObjectTooLarge above `max_bytes`, before reading when the length is sent, else after
    reading at most one byte more."""
    if max_bytes is None:
        return resp.read()
    length = resp.headers.get("Content-Length")
    if length is not None and int(length) > max_bytes:
        raise ObjectTooLarge(f"object {where} has {length} bytes > max_bytes {max_bytes}")
    data = resp.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise ObjectTooLarge(f"object {where} exceeds max_bytes {max_bytes}")
    return data


def _is_key(name: str) -> bool:
    try:
        validate_key(name)
    except ValueError:
        return False  # directory markers and foreign objects that could never be read back by key
    return True
