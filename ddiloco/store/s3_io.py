"""S3 object bodies sent and received without extra passes over them: what a syncer publishing a 193 MB
fragment several times a second pays per byte.

minio hashes every PUT body before it sends it; bodies of at least `UNSIGNED_MIN` go up as
`UNSIGNED-PAYLOAD` without `Content-MD5` instead (accepted by AWS S3, MinIO and SeaweedFS), small JSON bodies
are hashed as minio always does. Every payload learners and the syncer exchange carries the SHA-256 of its
data, which readers verify, so the server's check adds nothing they need; use HTTPS where the path is not
trusted. `Client` is minio's client with that one method changed (minio is pinned exactly;
tests/unit/test_s3_io.py guards it). A `Blob`'s parts are sent as they are, never joined, and `read_into`
lands a GET's body in memory the caller lends instead of a fresh copy.

Design notes (what skipping the hash gives up, and why that is safe): docs/internals.md, "S3",
"Bodies without extra passes".
"""

from __future__ import annotations

from typing import Any

import urllib3
from minio import Minio

from ddiloco.store.base import ObjectTooLarge
from ddiloco.store.blob import Data, Lend, as_bytes, parts_of

__all__ = ["UNSIGNED_MIN", "Client", "body_of", "read_into"]

UNSIGNED_MIN = 1 << 20
"""Bodies of at least this many bytes are sent unhashed (module docstring)."""
READ_STEP = 1 << 20


class _Parts:
    """A PUT body as the buffers of a `Data`, in order; its length is the object's size."""

    __slots__ = ("nbytes", "parts")

    def __init__(self, data: Data) -> None:
        self.parts, self.nbytes = parts_of(data), len(data)

    def __len__(self) -> int:
        return self.nbytes

    def __iter__(self) -> Any:
        return iter(self.parts)


def body_of(data: Data) -> bytes | _Parts:
    """What to give `Minio._put_object` as the body of `data`: the parts themselves from `UNSIGNED_MIN` on."""
    return _Parts(data) if len(data) >= UNSIGNED_MIN else as_bytes(data)


class Client(Minio):
    """minio's client; a `body_of` body is sent as UNSIGNED-PAYLOAD and without Content-MD5 (module docstring)."""

    def _build_headers(
        self,
        host: str,
        headers: dict[str, Any] | None = None,
        body: Any = None,
        creds: Any = None,
    ) -> tuple[dict[str, Any], Any]:
        if not isinstance(body, _Parts):
            return super()._build_headers(host, headers, body, creds)
        built, date = super()._build_headers(host, headers, None, creds)  # no body: nothing hashed
        built["Content-Length"] = str(len(body))
        if creds:
            built["x-amz-content-sha256"] = "UNSIGNED-PAYLOAD"
        return built, date


def read_into(resp: urllib3.BaseHTTPResponse, lend: Lend, max_bytes: int | None, where: str) -> memoryview:
    """The body of a GET answered with its Content-Length, read into `lend(size)`; ObjectTooLarge (body unread)
    above `max_bytes`. A body that ends short raises urllib3's error (transient: the caller retries)."""
    size = int(resp.headers["Content-Length"])
    if max_bytes is not None and size > max_bytes:
        raise ObjectTooLarge(f"object {where} has {size} bytes > max_bytes {max_bytes}")
    out, n = lend(size)[:size], 0
    while n < size:
        chunk = resp.read(min(READ_STEP, size - n))
        if not chunk:
            raise urllib3.exceptions.ProtocolError(f"{where}: body ended after {n} of {size} bytes")
        out[n : n + len(chunk)] = chunk
        n += len(chunk)
    return out
