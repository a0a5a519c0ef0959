"""Store.create (write-once) beyond the contract: file-store processes racing, crash safety, retries that
landed, wrappers, and the S3 conditional-PUT helpers (the real endpoint is in test_s3_store.py)."""

from __future__ import annotations

import errno
import inspect
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import urllib3
from minio import Minio
from minio.error import InvalidResponseError, S3Error

from ddiloco.store.base import AtomicCreateUnsupported, StoreError, StoreUnavailable
from ddiloco.store.file import FileStore
from ddiloco.store.memory import reset_memory_stores
from ddiloco.store.retry import RetryPolicy
from ddiloco.store.s3_create import put_if_absent
from ddiloco.store.shaped import Link, ShapedStore
from ddiloco.store.url import open_store
from ddiloco.store.wrapped import OutageStore
from tests._store_contract import race_to_create

REPO = Path(__file__).resolve().parents[2]
FAST = RetryPolicy(max_attempts=4, base_delay=0.001, max_delay=0.002, deadline=5.0)


@pytest.fixture(autouse=True)
def _fresh_memory():
    reset_memory_stores()
    yield
    reset_memory_stores()


# ---- file: processes ----

_CLAIMER = textwrap.dedent(
    """
    import os, sys, time
    from ddiloco.store.url import open_store
    store, me, go, n = open_store(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
    while not os.path.exists(go):
        time.sleep(0.001)
    won = [k for k in range(n) if store.create(f"claims/{k}", f"process-{me}".encode() * 64)]
    print("WON", *won, flush=True)
    """
)


def test_file_processes_racing_get_exactly_one_winner_per_key(tmp_path: Path) -> None:
    root, go, keys = tmp_path / "store", tmp_path / "go", 200
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _CLAIMER, root.as_uri(), str(p), str(go), str(keys)],
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            stdout=subprocess.PIPE,
            text=True,
        )
        for p in range(4)
    ]
    time.sleep(0.3)  # let them all start and wait on the go file, then release them together
    go.touch()
    won: dict[int, list[int]] = {}
    for p, proc in enumerate(procs):
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out
        won[p] = [int(k) for k in out.split("WON", 1)[1].split()]
    claimed = sorted(k for ks in won.values() for k in ks)
    assert claimed == list(range(keys))  # every key won once, by exactly one process
    store = FileStore(root)
    for p, ks in won.items():
        for k in ks:
            assert store.get(f"claims/{k}") == f"process-{p}".encode() * 64
    assert sorted(os.listdir(root / "claims")) == sorted(str(k) for k in range(keys))  # no temp files left


# ---- file: crash safety and retries ----


@pytest.mark.parametrize("backend", ["memory", "file"])
def test_threads_racing_many_rounds_get_one_winner_each(backend: str, tmp_path: Path) -> None:
    store = open_store("memory://rounds" if backend == "memory" else tmp_path.as_uri())
    for round_ in range(25):
        contents = [f"{round_}-{i}".encode() for i in range(8)]
        results = race_to_create(store, f"r/{round_}", contents)
        assert results.count(True) == 1, results
        assert store.get(f"r/{round_}") == contents[results.index(True)]


def test_file_create_never_exposes_a_partial_object(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = FileStore(tmp_path)
    seen = []
    real_link = os.link

    def checking_link(src: str, dst: str) -> None:
        seen.append((Path(src).read_bytes(), os.path.exists(dst)))  # the temp is complete before the link
        real_link(src, dst)

    monkeypatch.setattr(os, "link", checking_link)
    assert store.create("k", b"z" * 100_000)
    assert seen == [(b"z" * 100_000, False)]

    def crash(src: str, dst: str) -> None:
        raise KeyboardInterrupt  # the process dies between writing the temp file and linking it

    monkeypatch.setattr(os, "link", crash)
    with pytest.raises(KeyboardInterrupt):
        store.create("dir/crashed", b"y" * 100_000)
    assert not store.exists("dir/crashed") and os.listdir(tmp_path / "dir") == []  # no final, no temp


def test_file_create_retried_after_its_link_landed_still_reports_true(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # NFS: the link is done on the server, the reply is lost (ESTALE/EIO), the retry then meets EEXIST.
    store = FileStore(tmp_path, retry=FAST)
    real_link, calls = os.link, []

    def landed_then_failed(src: str, dst: str) -> None:
        calls.append(dst)
        real_link(src, dst)
        if len(calls) == 1:
            raise OSError(errno.ESTALE, "Stale file handle")

    monkeypatch.setattr(os, "link", landed_then_failed)
    assert store.create("lease", b"mine") is True
    assert store.get("lease") == b"mine" and store.stats.retries == 1 and len(calls) == 2
    assert store.create("lease", b"mine") is False  # a fresh call, no retry: taken is taken
    assert os.listdir(tmp_path) == ["lease"]


def test_file_create_retried_after_a_failure_loses_to_a_racer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = FileStore(tmp_path, retry=FAST)
    real_link, calls = os.link, []

    def failed_while_racer_won(src: str, dst: str) -> None:
        calls.append(dst)
        if len(calls) == 1:
            Path(dst).write_bytes(b"racer")  # someone else's create lands while our reply is lost
            raise OSError(errno.EIO, "I/O error")
        real_link(src, dst)

    monkeypatch.setattr(os, "link", failed_while_racer_won)
    assert store.create("lease", b"mine") is False
    assert store.get("lease") == b"racer"


def test_file_create_persistent_io_error_becomes_unavailable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = FileStore(tmp_path, retry=FAST)
    monkeypatch.setattr(os, "link", lambda src, dst: (_ for _ in ()).throw(OSError(errno.EIO, "I/O error")))
    with pytest.raises(StoreUnavailable):
        store.create("k", b"v")
    assert store.stats.retries == FAST.max_attempts - 1 and os.listdir(tmp_path) == []


def test_file_without_hard_links_refuses_to_create(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = FileStore(tmp_path, retry=FAST)
    monkeypatch.setattr(
        os, "link", lambda src, dst: (_ for _ in ()).throw(PermissionError(errno.EPERM, "no"))
    )
    with pytest.raises(AtomicCreateUnsupported, match="hard links"):
        store.create("k", b"v")
    assert os.listdir(tmp_path) == []


def test_file_create_directory_rules(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    (tmp_path / "empty-dir").mkdir()  # left by a crashed writer: the key wins, as with put
    assert store.create("empty-dir", b"1") is True and store.get("empty-dir") == b"1"
    store.put("a/b/c", b"x")
    with pytest.raises(StoreError, match="prefix of other keys"):
        store.create("a/b", b"y")
    with pytest.raises(StoreError, match="a parent of it is an object"):
        store.create("a/b/c/d", b"y")


def test_memory_create_follows_the_file_layout_rules() -> None:
    store = open_store("memory://layout")
    store.put("a/b/c", b"x")
    with pytest.raises(StoreError):
        store.create("a/b", b"y")
    with pytest.raises(StoreError):
        store.create("a/b/c/d", b"y")
    assert store.list() == ["a/b/c"]


def test_file_create_survives_a_prune_racing_its_mkdir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = FileStore(tmp_path)
    real_mkdir, calls = Path.mkdir, []

    def racing_mkdir(self: Path, *args, **kwargs) -> None:
        calls.append(self)
        if len(calls) == 1:
            raise FileExistsError(str(self))
        real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", racing_mkdir)
    assert store.create("learners/0/incarnations/1", b"x") is True and len(calls) >= 2


# ---- wrappers ----


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_shaped_store_passes_create_through_and_prices_it_like_a_put() -> None:
    clock = FakeClock()
    inner = open_store("memory://shaped-create")
    store = ShapedStore(inner, Link(latency=0.05), clock=clock, sleep=clock.sleep)
    run = store.child("run-1")
    assert run.create("lease", b"a") is True
    assert run.create("lease", b"b") is False
    assert inner.get("run-1/lease") == b"a"
    assert clock.now == pytest.approx(4 * 0.05)  # two round trips
    snap = store.link_stats.snapshot()
    assert snap["requests"] == 2 and snap["bytes_up"] == 2
    assert inner.stats.creates == 2 and inner.stats.create_conflicts == 1  # counted once, shared
    assert race_to_create(store, "race", [bytes([i]) for i in range(8)]).count(True) == 1


def test_outage_refuses_create_before_it_happens(tmp_path: Path) -> None:
    inner = FileStore(tmp_path)
    now = [5.0]
    store = OutageStore(inner, [(0.0, 10.0)], clock=lambda: now[0])
    with pytest.raises(StoreUnavailable, match="create"):
        store.create("lease", b"a")
    assert not inner.exists("lease")  # refused, so certainly not created: never a wrong False later
    now[0] = 11.0
    assert store.create("lease", b"a") is True and store.create("lease", b"b") is False


# ---- S3 conditional PUT helper (no server: the client is faked) ----


def test_minio_private_put_object_takes_headers() -> None:
    # s3_create uses Minio._put_object (put_object cannot send If-None-Match): fail here if minio changes it.
    assert list(inspect.signature(Minio._put_object).parameters)[:5] == [
        "self",
        "bucket_name",
        "object_name",
        "data",
        "headers",
    ]


class FakeClient:
    def __init__(self, exc: BaseException | None = None) -> None:
        self.exc, self.calls = exc, []

    def _put_object(self, bucket: str, name: str, data: bytes, headers: dict[str, str]) -> None:
        self.calls.append((bucket, name, data, dict(headers)))
        if self.exc is not None:
            raise self.exc


def _s3_error(code: str, status: int) -> S3Error:
    return S3Error(urllib3.HTTPResponse(status=status), code, "msg", "/b/k", "req", "host")


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (None, True),
        (_s3_error("PreconditionFailed", 412), False),
        (InvalidResponseError(412, "text/plain", None), False),  # 412 without an XML body
    ],
)
def test_put_if_absent_maps_412_to_false(exc: BaseException | None, expected: bool) -> None:
    client = FakeClient(exc)
    assert put_if_absent(client, "b", "k", b"data") is expected  # type: ignore[arg-type]
    assert client.calls == [
        ("b", "k", b"data", {"If-None-Match": "*", "Content-Type": "application/octet-stream"})
    ]


@pytest.mark.parametrize(
    "exc",
    [
        _s3_error("ConditionalRequestConflict", 409),  # retried by S3Store's policy (see test_store.py)
        _s3_error("AccessDenied", 403),
        urllib3.exceptions.ReadTimeoutError(None, "/", "timed out"),
    ],
)
def test_put_if_absent_lets_other_errors_through(exc: BaseException) -> None:
    with pytest.raises(type(exc)):
        put_if_absent(FakeClient(exc), "b", "k", b"x")  # type: ignore[arg-type]
