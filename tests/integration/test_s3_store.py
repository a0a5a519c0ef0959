"""S3Store against a real SeaweedFS server (tests/_seaweed.py): the store contract, errors, outages, and
write-once creates (If-None-Match: *, its probe and the fallback for endpoints without it)."""

from __future__ import annotations

import io
import logging
import os
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest
import urllib3
from minio import Minio
from minio.error import S3Error

from ddiloco.platform.ports import free_port
from ddiloco.store.base import (
    AtomicCreateUnsupported,
    ObjectTooLarge,
    Store,
    StoreConfigError,
    StoreUnavailable,
)
from ddiloco.store.blob import Blob
from ddiloco.store.retry import RetryPolicy
from ddiloco.store.s3 import S3Store
from ddiloco.store.url import open_store
from tests._seaweed import SeaweedServer, seaweed_server
from tests._store_contract import CONTRACT, ContractCheck

pytestmark = pytest.mark.s3

FAST = RetryPolicy(max_attempts=3, base_delay=0.01, max_delay=0.05, deadline=3.0)


@pytest.fixture
def store(s3_server: SeaweedServer) -> Store:
    """An empty store: a fresh prefix in the session's bucket."""
    return open_store(s3_server.url(f"t-{uuid.uuid4().hex[:12]}"), env=s3_server.env(), retry=FAST)


def _raw_client(server: SeaweedServer) -> Minio:
    return Minio(server.endpoint.removeprefix("http://"), server.access_key, server.secret_key, secure=False)


@pytest.mark.parametrize("check", CONTRACT, ids=lambda c: c.__name__)
def test_contract(store: Store, check: ContractCheck) -> None:
    check(store)


def test_url_prefix_maps_to_object_names(s3_server: SeaweedServer) -> None:
    run = f"pfx-{uuid.uuid4().hex[:8]}"
    store = open_store(s3_server.url(f"{run}/sub"), env=s3_server.env())
    assert isinstance(store, S3Store) and store.url == f"s3://{s3_server.bucket}/{run}/sub"
    store.child("run-1").put("global/0/latest", b"{}")
    names = [
        o.object_name
        for o in _raw_client(s3_server).list_objects(s3_server.bucket, f"{run}/", recursive=True)
    ]
    assert names == [f"{run}/sub/run-1/global/0/latest"]


def test_object_larger_than_multipart_threshold_goes_up_in_one_put(store: Store) -> None:
    payload = os.urandom(6 * 1024 * 1024 + 1)  # minio would split this into multipart by default
    store.put("global/0/v1", payload)
    assert store.get("global/0/v1") == payload
    assert store.get("global/0/v1", max_bytes=len(payload)) == payload


def test_big_payloads_go_up_from_their_parts_unhashed_and_come_back_into_lent_memory(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """s3_io: a body of 1 MiB and more is sent from the Blob's own buffers as UNSIGNED-PAYLOAD (SeaweedFS
    accepts it), by put and by create; minio hashes only the small bodies; get_into reads it back whole."""
    import minio.api

    hashed: list[int] = []
    for name in ("sha256_hash", "md5sum_hash"):
        real = getattr(minio.api, name)
        monkeypatch.setattr(minio.api, name, lambda b, real=real: hashed.append(len(b or b"")) or real(b))
    parts = [b"head", memoryview(bytearray(os.urandom(1 << 20))), os.urandom(1_500_001)]
    blob, joined = Blob(parts), b"".join(bytes(p) for p in parts)
    store.put("big/put", blob)
    assert store.create("big/create", blob) and not store.create("big/create", Blob([b"x" * (2 << 20)]))
    assert max(hashed) < (1 << 20), hashed  # the bodies above were never hashed by the client
    for key in ("big/put", "big/create"):
        lent: list[int] = []
        view = store.get_into(key, lambda n, lent=lent: lent.append(n) or memoryview(bytearray(n)))
        assert bytes(view) == joined and lent == [len(joined)]
    with pytest.raises(ObjectTooLarge):
        store.get_into("big/put", lambda n: memoryview(bytearray(n)), max_bytes=len(joined) - 1)


def test_threads_share_one_store(store: Store) -> None:
    errors: list[BaseException] = []

    def work(n: int) -> None:
        try:
            for i in range(10):
                store.put(f"w{n}/{i}", f"{n}-{i}".encode())
                assert store.get(f"w{n}/{i}") == f"{n}-{i}".encode()
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(store.list()) == 40


def test_aws_style_environment_is_accepted(s3_server: SeaweedServer) -> None:
    env = {
        "AWS_ENDPOINT_URL": s3_server.endpoint,
        "AWS_ACCESS_KEY_ID": s3_server.access_key,
        "AWS_SECRET_ACCESS_KEY": s3_server.secret_key,
    }
    store = open_store(s3_server.url(f"aws-{uuid.uuid4().hex[:8]}"), env=env)
    store.put("k", b"v")
    assert store.get("k") == b"v"


def test_missing_bucket_is_a_config_error_saying_what_to_do(s3_server: SeaweedServer) -> None:
    store = open_store("s3://no-such-bucket-ddiloco/run", env=s3_server.env(), retry=FAST)
    ops = (lambda: store.put("k", b"v"), lambda: store.get("k"), store.list, store.check)
    for op in (*ops, lambda: store.create("k", b"v")):
        with pytest.raises(StoreConfigError) as info:
            op()
        message = str(info.value)
        assert "bucket 'no-such-bucket-ddiloco' does not exist" in message
        assert s3_server.endpoint in message and "mc mb" in message and "\n" not in message
    assert store.stats.retries == 0


@pytest.mark.parametrize("which", ["wrong-secret", "unknown-key"])
def test_wrong_credentials_are_a_config_error(s3_server: SeaweedServer, which: str) -> None:
    env = s3_server.env()
    if which == "wrong-secret":
        env["DDILOCO_S3_SECRET_KEY"] = "not-the-secret"
    else:
        env["DDILOCO_S3_ACCESS_KEY"] = "nobody"
    store = open_store(s3_server.url("auth"), env=env, retry=FAST)
    with pytest.raises(StoreConfigError, match="DDILOCO_S3_ACCESS_KEY") as info:
        store.put("k", b"v")
    assert "refused" in str(info.value)
    assert store.stats.retries == 0


def test_anonymous_requests_are_refused(s3_server: SeaweedServer) -> None:
    # Proves the server really enforces auth, so the credential tests above mean something.
    with pytest.raises(urllib.error.HTTPError) as info:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        opener.open(f"{s3_server.endpoint}/{s3_server.bucket}?list-type=2", timeout=5)
    assert info.value.code == 403


def test_closed_port_becomes_unavailable_quickly(s3_server: SeaweedServer) -> None:
    env = s3_server.env() | {"DDILOCO_S3_ENDPOINT": f"127.0.0.1:{free_port()}"}
    store = open_store("s3://bucket/run", env=env, retry=FAST)
    start = time.monotonic()
    with pytest.raises(StoreUnavailable, match="3 attempt") as info:
        store.get("global/0/latest")
    assert time.monotonic() - start < 5.0
    assert isinstance(info.value.__cause__, urllib3.exceptions.HTTPError)
    assert store.stats.retries == FAST.max_attempts - 1


def test_server_restart_is_survived_by_retries(tmp_path: Path) -> None:
    with seaweed_server(tmp_path) as server:
        store = open_store(
            server.url("restart"),
            env=server.env(),
            retry=RetryPolicy(max_attempts=100, deadline=45, max_delay=1.0),
        )
        store.put("global/0/latest", b'{"version": 1}')
        server.kill()
        with pytest.raises(StoreUnavailable):
            open_store(server.url("restart"), env=server.env(), retry=FAST).get("global/0/latest")

        restarted = threading.Event()

        def bring_back() -> None:
            time.sleep(0.5)
            server.start()
            restarted.set()

        thread = threading.Thread(target=bring_back)
        thread.start()
        try:
            assert store.get("global/0/latest") == b'{"version": 1}'  # blocks in retries until it is back
            store.put("global/0/latest", b'{"version": 2}')
        finally:
            thread.join()
        assert restarted.is_set()
        assert store.stats.retries >= 1
        assert (
            _raw_client(server).get_object(server.bucket, "restart/global/0/latest").read()
            == b'{"version": 2}'
        )


def test_get_max_bytes_does_not_download_the_body(store: Store) -> None:
    store.put("huge", b"z" * (4 * 1024 * 1024))
    before = store.stats.snapshot()["bytes_read"]
    with pytest.raises(ObjectTooLarge, match="4194304 bytes"):
        store.get("huge", max_bytes=1024)
    assert store.stats.snapshot()["bytes_read"] == before
    assert store.get("huge", max_bytes=4 * 1024 * 1024) == b"z" * (4 * 1024 * 1024)  # connection still fine


def test_list_skips_objects_that_are_not_keys(store: Store, s3_server: SeaweedServer) -> None:
    prefix = store.url.removeprefix(f"s3://{s3_server.bucket}/")
    client = _raw_client(s3_server)
    for name in ("with space", "dir/", "ok/ü"):
        client.put_object(s3_server.bucket, f"{prefix}/{name}", io.BytesIO(b"1"), 1)
    store.put("ok/key", b"2")
    assert store.list() == ["ok/key"]


# ---- create: If-None-Match: * on SeaweedFS (see ddiloco/store/s3_create.py) ----


def _probe_objects(server: SeaweedServer, store: Store) -> list[str]:
    prefix = store.url.removeprefix(f"s3://{server.bucket}/")
    client = _raw_client(server)
    return [o.object_name for o in client.list_objects(server.bucket, f"{prefix}/_probe/", recursive=True)]


def test_seaweedfs_refuses_a_second_conditional_put_with_412(store: Store, s3_server: SeaweedServer) -> None:
    assert isinstance(store, S3Store)
    assert store.create("lease", b"first") is True
    assert store._conn.create.atomic is True  # the probe found real support: no fallback
    assert _probe_objects(s3_server, store) == []  # and cleaned up after itself
    name = store.url.removeprefix(f"s3://{s3_server.bucket}/") + "/lease"
    client = _raw_client(s3_server)
    with pytest.raises(S3Error) as info:
        client._put_object(s3_server.bucket, name, b"second", {"If-None-Match": "*"})
    assert info.value.code == "PreconditionFailed" and info.value.response.status == 412
    assert client.get_object(s3_server.bucket, name).read() == b"first"


def test_separate_connections_racing_get_one_winner(s3_server: SeaweedServer) -> None:
    """Separate connections, as separate learner processes have (the contract race shares one)."""
    url = s3_server.url(f"race-{uuid.uuid4().hex[:8]}")
    stores = [open_store(url, env=s3_server.env(), retry=FAST) for _ in range(4)]
    for n, s in enumerate(stores):
        assert s.create(f"warm/{n}", b"w")  # each connection probes before the race
    contents = [f"claimant-{i}".encode() for i in range(4)]
    barrier = threading.Barrier(4)
    results: list[bool | None] = [None] * 4

    def claim(i: int) -> None:
        barrier.wait(timeout=10)
        results[i] = stores[i].create("claim", contents[i])

    threads = [threading.Thread(target=claim, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert results.count(True) == 1 and results.count(False) == 3, results
    assert stores[0].get("claim") == contents[results.index(True)]


def _after_probe(store: Store) -> Minio:
    assert isinstance(store, S3Store)
    assert store.create("warm-up", b"w")  # the probe runs on the first create
    return store._conn.client


def test_create_retried_after_a_lost_answer_reports_true(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    client, calls = _after_probe(store), []
    real = client._put_object

    def landed_then_timed_out(*args, **kwargs):
        calls.append(args[1])
        result = real(*args, **kwargs)
        if len(calls) == 1:
            raise urllib3.exceptions.ReadTimeoutError(None, "/", "read timed out")
        return result

    monkeypatch.setattr(client, "_put_object", landed_then_timed_out)
    before = store.stats.retries
    assert store.create("lease", b"mine") is True  # the retry met 412 but the bytes are its own
    assert len(calls) == 2 and store.stats.retries == before + 1
    assert store.create("lease", b"mine") is False  # a new call, answered at once: taken


def test_create_retried_after_a_failure_loses_to_a_racer(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    client, calls = _after_probe(store), []
    real = client._put_object

    def failed_while_racer_won(*args, **kwargs):
        calls.append(args[1])
        if len(calls) == 1:
            real(args[0], args[1], b"racer", {"If-None-Match": "*"})
            raise urllib3.exceptions.ProtocolError("Connection aborted")
        return real(*args, **kwargs)

    monkeypatch.setattr(client, "_put_object", failed_while_racer_won)
    assert store.create("lease", b"mine") is False
    assert store.get("lease") == b"racer"


def test_conditional_request_conflict_409_is_retried(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    client, calls = _after_probe(store), []
    real = client._put_object

    def conflict_once(*args, **kwargs):
        calls.append(args[1])
        if len(calls) == 1:
            raise S3Error(
                urllib3.HTTPResponse(status=409), "ConditionalRequestConflict", "retry", "/", "r", "h"
            )
        return real(*args, **kwargs)

    monkeypatch.setattr(client, "_put_object", conflict_once)
    assert store.create("lease", b"mine") is True and store.get("lease") == b"mine"
    assert len(calls) == 2


def test_endpoint_ignoring_if_none_match_is_detected(
    store: Store, s3_server: SeaweedServer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    assert isinstance(store, S3Store)
    client = store._conn.client
    real = client._put_object

    def ignores_the_header(bucket, name, data, headers=None, *rest):
        return real(bucket, name, data, {k: v for k, v in (headers or {}).items() if k != "If-None-Match"})

    monkeypatch.setattr(client, "_put_object", ignores_the_header)
    with caplog.at_level(logging.WARNING, logger="ddiloco.store.s3_create"):
        assert store.create("lease", b"first") is True  # best effort: exists, then put
        assert store.create("lease", b"second") is False
        assert store.child("run").create("x", b"1") is True  # children share the probe's answer
    assert store.get("lease") == b"first"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and s3_server.endpoint in warnings[0] and "racy" in warnings[0]
    assert "overwrote" in warnings[0]
    with pytest.raises(AtomicCreateUnsupported, match="If-None-Match"):
        store.create("strict-lease", b"x", strict=True)
    assert not store.exists("strict-lease")
    assert _probe_objects(s3_server, store) == []


def test_endpoint_refusing_if_none_match_is_detected_without_retries(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert isinstance(store, S3Store)
    client = store._conn.client
    real = client._put_object

    def refuses_the_header(bucket, name, data, headers=None, *rest):
        if "If-None-Match" in (headers or {}):
            raise S3Error(urllib3.HTTPResponse(status=501), "NotImplemented", "no", "/", "r", "h")
        return real(bucket, name, data, headers, *rest)

    monkeypatch.setattr(client, "_put_object", refuses_the_header)
    assert store.create("lease", b"first") is True and store.create("lease", b"2") is False
    assert store._conn.create.atomic is False and "refused" in store._conn.create.reason
    assert store.stats.retries == 0


def test_probe_that_cannot_reach_the_endpoint_decides_nothing(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert isinstance(store, S3Store)
    store.check()
    client = store._conn.client
    real = client._put_object
    down = [True]

    def unreachable(*args, **kwargs):
        if down[0]:
            raise urllib3.exceptions.NewConnectionError(None, "connection refused")
        return real(*args, **kwargs)

    monkeypatch.setattr(client, "_put_object", unreachable)
    with pytest.raises(StoreUnavailable):
        store.create("lease", b"x")
    assert store._conn.create.atomic is None
    down[0] = False
    assert store.create("lease", b"x") is True and store._conn.create.atomic is True
