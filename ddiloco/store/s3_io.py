"""S3 object bodies sent and received without extra passes over them: what a syncer publishing a 193 MB
fragment several times a second pays per byte.

Design choices:
- minio 7.2.20 hashes every PUT body before it sends it (`Minio._build_headers`): SHA-256 for the signature
  over plain HTTP (`x-amz-content-sha256`), MD5 for `Content-MD5` over HTTPS; and a server checks that hash
  again. Bodies of at least `UNSIGNED_MIN` now go up as `UNSIGNED-PAYLOAD` (SigV4 then signs the request's
  headers, not its body) and without `Content-MD5`. AWS S3 documents the value for any request; MinIO skips
  the payload check for it whatever the transport (cmd/signature-v4-utils.go, `skipContentSha256Cksum`);
  SeaweedFS 4.48 takes it (tests/integration/test_s3_store.py). Smaller bodies (JSON: status, pointers,
  round records) are hashed as minio always does. `Client` is minio's client with that one method changed
  (minio is pinned exactly; tests/unit/test_s3_io.py guards the method's signature and what it returns).
- What that gives up: the server no longer checks that the body it stored is the one the client hashed. TCP's
  checksum (and TLS's MAC over HTTPS) still guard the transfer; every payload the syncer and learners
  exchange (updates, global versions and deltas, the syncer's momentum and master) carries the SHA-256 of its
  data, which every reader verifies, and in signed runs an HMAC; a tokenized corpus file or an exported model
  has no such check on S3 (corpora are checked by size there, `ddiloco.streamed`). Over plain HTTP a party
  on the path could already change every GET's body (responses are not signed), so signing PUT bodies
  protected nothing that reads left open: use HTTPS where the path is not trusted.
- A `Blob`'s parts are sent as they are (urllib3 `sendall`s each part of an iterable body under an explicit
  Content-Length) instead of being joined into one bytes object first: a fresh copy of every payload.
- `read_into`: a GET's body lands in memory the caller lends, 1 MiB at a time, instead of a fresh bytes object of
  the object's size that is then copied (a read-back of a 193 MB fragment faulted in 193 MB of new pages).
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
