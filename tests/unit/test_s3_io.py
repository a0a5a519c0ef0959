"""s3_io.Client against minio's own header building (minio is pinned exactly): a `body_of` body of 1 MiB and
more is not hashed, over HTTP or HTTPS, and is signed as UNSIGNED-PAYLOAD; small bodies are as minio makes them."""

from __future__ import annotations

import inspect

import minio.api
import pytest
from minio import Minio
from minio.credentials import Credentials

from ddiloco.store.blob import Blob
from ddiloco.store.s3_io import UNSIGNED_MIN, Client, body_of

CREDS = Credentials("key", "secret")


def test_minio_builds_headers_with_the_signature_client_overrides() -> None:
    params = list(inspect.signature(Minio._build_headers).parameters)
    assert params == ["self", "host", "headers", "body", "creds"]


@pytest.mark.parametrize("secure", [False, True])
def test_a_big_body_is_sent_unsigned_and_unhashed(secure: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_hash(data: object) -> None:
        if data is not None:
            pytest.fail("a big body was hashed")

    monkeypatch.setattr(minio.api, "sha256_hash", lambda d: no_hash(d) or "e3b0c442")
    monkeypatch.setattr(minio.api, "md5sum_hash", lambda d: no_hash(d))
    client = Client("s3.example:9000", "key", "secret", secure=secure, region="us-east-1")
    blob = Blob([b"head", bytearray(UNSIGNED_MIN)])
    headers, _ = client._build_headers("s3.example:9000", {"If-None-Match": "*"}, body_of(blob), CREDS)
    assert headers["x-amz-content-sha256"] == "UNSIGNED-PAYLOAD"
    assert headers["Content-Length"] == str(len(blob)) and "Content-MD5" not in headers
    assert headers["If-None-Match"] == "*"
    assert [bytes(p) for p in body_of(blob)] == [bytes(p) for p in blob.parts]


@pytest.mark.parametrize("secure", [False, True])
def test_a_small_body_is_hashed_as_minio_does(secure: bool) -> None:
    client = Client("s3.example:9000", "key", "secret", secure=secure, region="us-east-1")
    plain = Minio("s3.example:9000", "key", "secret", secure=secure, region="us-east-1")
    body = body_of(Blob([b"{}", b"small"]))
    assert body == b"{}small"
    ours, _ = client._build_headers("h", {}, body, CREDS)
    theirs, _ = plain._build_headers("h", {}, body, CREDS)
    assert {k: v for k, v in ours.items() if k != "x-amz-date"} == {
        k: v for k, v in theirs.items() if k != "x-amz-date"
    }
    assert ours["x-amz-content-sha256"] != "UNSIGNED-PAYLOAD" or secure
