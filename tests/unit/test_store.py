"""Store contract on memory:// and file://, file-store atomicity across processes, URLs, retry policy."""

from __future__ import annotations

import errno
import os
import random
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import urllib3
from minio.error import S3Error, ServerError

from ddiloco.store.base import NotFound, Store, StoreConfigError, StoreError, StoreUnavailable
from ddiloco.store.file import FileStore
from ddiloco.store.memory import MemoryStore, reset_memory_stores
from ddiloco.store.retry import RetryPolicy, call_with_retry
from ddiloco.store.s3 import S3Settings, is_transient
from ddiloco.store.url import open_store
from tests._store_contract import CONTRACT, ContractCheck

REPO = Path(__file__).resolve().parents[2]
FAST = RetryPolicy(max_attempts=4, base_delay=0.001, max_delay=0.002, deadline=5.0)


@pytest.fixture(autouse=True)
def _fresh_memory():
    reset_memory_stores()
    yield
    reset_memory_stores()


@pytest.fixture(params=["memory", "file"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    if request.param == "memory":
        return open_store("memory://contract")
    return open_store(tmp_path.as_uri())


@pytest.mark.parametrize("check", CONTRACT, ids=lambda c: c.__name__)
def test_contract(store: Store, check: ContractCheck) -> None:
    check(store)


def test_key_cannot_be_object_and_prefix(store: Store) -> None:
    # The file system forbids it; memory:// forbids it too so tests cannot rely on what files cannot do.
    store.put("a/b", b"1")
    with pytest.raises(StoreError):
        store.put("a/b/c", b"2")
    store.delete("a/b")
    store.put("a/b/c", b"2")
    with pytest.raises(StoreError):
        store.put("a/b", b"1")
    assert store.list() == ["a/b/c"]


# ---- memory ----


def test_memory_stores_share_by_name_and_reset() -> None:
    one, two, other = (
        open_store("memory://shared"),
        open_store("memory://shared"),
        open_store("memory://other"),
    )
    one.put("k", b"v")
    assert two.get("k") == b"v"
    assert other.list() == []
    assert one.stats is two.stats
    rooted = open_store("memory://shared/run-1")
    rooted.put("x", b"y")
    assert rooted.url == "memory://shared/run-1"
    assert one.list() == ["k", "run-1/x"]
    reset_memory_stores()
    assert open_store("memory://shared").list() == []


def test_memory_store_is_thread_safe() -> None:
    store = MemoryStore("threads")

    def work(n: int) -> None:
        for i in range(200):
            store.put(f"t{n}/{i}", bytes([n]))
            assert store.get(f"t{n}/{i}") == bytes([n])
            if i % 2:
                store.delete(f"t{n}/{i}")

    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(store.list()) == 4 * 100
    assert store.stats.puts == 800


# ---- file ----

_READER = textwrap.dedent(
    """
    import sys, time
    from ddiloco.store.base import NotFound
    from ddiloco.store.url import open_store
    store = open_store(sys.argv[1])
    stop = sys.argv[2]
    import os
    reads = torn = 0
    while not os.path.exists(stop):
        try:
            data = store.get("global/0/v")
        except NotFound:
            continue
        reads += 1
        if len(data) != 1 << 20 or data.count(data[:1]) != len(data):
            torn += 1
        names = store.list()
        if names != ["global/0/v"]:
            print("LISTED", names, flush=True)
            torn += 1
    print(reads, torn, flush=True)
    """
)


def test_file_put_is_atomic_for_a_reader_in_another_process(tmp_path: Path) -> None:
    root = tmp_path / "store"
    store = open_store(str(root))
    store.put("global/0/v", bytes([0]) * (1 << 20))
    stop = tmp_path / "stop"
    reader = subprocess.Popen(
        [sys.executable, "-c", _READER, root.as_uri(), str(stop)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 1.5
        version = 0
        while time.monotonic() < deadline:
            version += 1
            store.put("global/0/v", bytes([version % 251]) * (1 << 20))
    finally:
        stop.touch()
        out, _ = reader.communicate(timeout=30)
    reads, torn = (int(x) for x in out.split()[-2:])
    assert reader.returncode == 0
    assert torn == 0, out
    assert reads > 0 and version > 10
    assert sorted(p.name for p in (root / "global" / "0").iterdir()) == ["v"]  # no temp file left behind


def test_file_concurrent_writers_use_distinct_temp_files(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    errors: list[BaseException] = []

    def write(n: int) -> None:
        try:
            for _ in range(30):
                store.put("p/latest", bytes([n]) * 65536)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    data = store.get("p/latest")
    assert len(data) == 65536 and data.count(data[:1]) == 65536
    assert os.listdir(tmp_path / "p") == ["latest"]


def test_file_list_skips_temp_and_foreign_files(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    store.put("global/0/v1", b"x")
    (tmp_path / "global" / "0" / ".v2.tmp-123-456-deadbeef").write_bytes(b"partial")
    (tmp_path / "global" / "0" / "not a key").write_bytes(b"foreign")
    assert store.list() == ["global/0/v1"]
    with pytest.raises(ValueError):
        store.put("global/0/.v2.tmp-1-2-ab", b"x")


def test_file_delete_prunes_empty_directories(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "root")
    store.put("a/b/c/d", b"1")
    store.put("a/keep", b"2")
    store.delete("a/b/c/d")
    assert sorted(os.listdir(tmp_path / "root" / "a")) == ["keep"]
    assert (tmp_path / "root").is_dir()  # never prunes the root itself
    store.delete("a/keep")
    assert os.listdir(tmp_path / "root") == []


def test_file_fsync_mode_roundtrips(tmp_path: Path) -> None:
    store = FileStore(tmp_path, fsync=True)
    store.put("x/y", b"durable")
    assert store.get("x/y") == b"durable"


def test_file_transient_errno_is_retried_and_counted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = FileStore(tmp_path, retry=FAST)
    real_replace = os.replace
    failures = iter([OSError(errno.ESTALE, "Stale file handle"), OSError(errno.EIO, "I/O error")])

    def flaky_replace(src: str, dst: str) -> None:
        exc = next(failures, None)
        if exc is not None:
            raise exc
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", flaky_replace)
    store.put("k", b"v")
    assert store.get("k") == b"v"
    assert store.stats.retries == 2
    assert store.list() == ["k"]  # the failed attempts' temp files were removed


def test_file_persistent_io_error_becomes_unavailable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = FileStore(tmp_path, retry=FAST)

    def broken(src: str, dst: str) -> None:
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(os, "replace", broken)
    with pytest.raises(StoreUnavailable) as info:
        store.put("k", b"v")
    assert isinstance(info.value.__cause__, OSError)
    assert store.stats.retries == FAST.max_attempts - 1


def test_file_access_errors_say_what_to_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = FileStore(tmp_path, retry=FAST)

    def denied(*args: object, **kwargs: object) -> int:
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(os, "open", denied)
    with pytest.raises(StoreConfigError, match="permission denied.*point --store elsewhere"):
        store.put("k", b"v")
    assert store.stats.retries == 0


def test_file_put_under_an_object_is_a_store_error(tmp_path: Path) -> None:
    (tmp_path / "plain").write_bytes(b"not a directory")
    with pytest.raises(StoreError, match="parent"):
        FileStore(tmp_path).put("plain/child", b"x")


# ---- open_store ----


def test_open_store_paths_and_file_urls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    rel = open_store("runs/r1")
    assert isinstance(rel, FileStore)
    assert rel.url == (tmp_path / "runs" / "r1").as_uri()
    assert (tmp_path / "runs" / "r1").is_dir()
    absolute = open_store(str(tmp_path / "abs"))
    assert absolute.url == (tmp_path / "abs").as_uri()
    by_url = open_store((tmp_path / "runs" / "r1").as_uri())
    rel.put("k", b"v")
    assert by_url.get("k") == b"v"
    assert open_store(f"file://localhost{tmp_path}/runs/r1").get("k") == b"v"


@pytest.mark.parametrize(
    ("url", "match"),
    [
        ("gs://bucket/x", "unsupported store URL scheme 'gs'.*s3://bucket"),
        ("", "empty store URL"),
        ("memory://", "memory://NAME"),
        ("memory://x/../y", "bad store URL"),
        ("file://relative/dir", "three slashes"),
        ("s3://", "s3://bucket"),
        ("s3://bucket/a//b", "bad store URL"),
        ("memory://x?y=1", "no '\\?'"),
    ],
)
def test_open_store_rejects_bad_urls(url: str, match: str) -> None:
    with pytest.raises(StoreConfigError, match=match):
        open_store(url)


def test_open_store_s3_needs_endpoint_and_credentials() -> None:
    with pytest.raises(StoreConfigError, match="DDILOCO_S3_ENDPOINT"):
        open_store("s3://bucket/run", env={})
    with pytest.raises(StoreConfigError, match="DDILOCO_S3_ACCESS_KEY and DDILOCO_S3_SECRET_KEY"):
        open_store("s3://bucket/run", env={"DDILOCO_S3_ENDPOINT": "127.0.0.1:9000"})
    with pytest.raises(StoreConfigError, match="AWS_SECRET_ACCESS_KEY is not"):
        open_store("s3://bucket", env={"S3_ENDPOINT": "h:1", "AWS_ACCESS_KEY_ID": "k"})
    with pytest.raises(StoreConfigError, match="invalid S3 bucket name"):
        open_store(
            "s3://B_/x", env={"S3_ENDPOINT": "h:1", "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"}
        )
    store = open_store(
        "s3://bucket/pre/fix", env={"S3_ENDPOINT": "h:1", "MINIO_ACCESS_KEY": "k", "MINIO_SECRET_KEY": "s"}
    )
    assert store.url == "s3://bucket/pre/fix"
    assert store.child("run").url == "s3://bucket/pre/fix/run"


@pytest.mark.parametrize(
    ("env", "endpoint", "secure", "source"),
    [
        (
            {"DDILOCO_S3_ENDPOINT": "minio-service.kubeflow:9000"},
            "minio-service.kubeflow:9000",
            False,
            "DDILOCO",
        ),
        ({"DDILOCO_S3_ENDPOINT": "https://s3.example.com/"}, "s3.example.com", True, "DDILOCO"),
        (
            {"DDILOCO_S3_ENDPOINT": "seaweedfs.kubeflow:9000", "DDILOCO_S3_SECURE": "1"},
            "seaweedfs.kubeflow:9000",
            True,
            "DDILOCO",
        ),
        ({"AWS_ENDPOINT_URL": "http://h:1", "S3_ENDPOINT": "ignored:2"}, "h:1", False, "AWS"),
        ({"S3_ENDPOINT": "h:2"}, "h:2", False, "AWS"),
    ],
)
def test_s3_settings_from_env(env: dict[str, str], endpoint: str, secure: bool, source: str) -> None:
    creds = {"AWS_ACCESS_KEY_ID": "aws-k", "AWS_SECRET_ACCESS_KEY": "aws-s"}
    if source == "DDILOCO":
        creds |= {"DDILOCO_S3_ACCESS_KEY": "dd-k", "DDILOCO_S3_SECRET_KEY": "dd-s"}
    settings = S3Settings.from_env({**env, **creds})
    assert (settings.endpoint, settings.secure) == (endpoint, secure)
    assert settings.access_key == ("dd-k" if source == "DDILOCO" else "aws-k")
    assert "dd-s" not in repr(settings) and "aws-s" not in repr(settings)


@pytest.mark.parametrize(
    "endpoint", ["http://h:1/bucket", "ftp://h:1", "h:abc", "http://h:99999", "bad host:1"]
)
def test_s3_bad_endpoint_is_config_error(endpoint: str) -> None:
    env = {"DDILOCO_S3_ENDPOINT": endpoint, "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"}
    with pytest.raises(StoreConfigError, match="bad S3 endpoint"):
        open_store("s3://bucket/x", env=env, retry=FAST).list()  # 'bad host' only fails on first use


def _s3_error(code: str, status: int) -> S3Error:
    return S3Error(urllib3.HTTPResponse(status=status), code, "msg", "/b/k", "req", "host")


@pytest.mark.parametrize(
    ("exc", "transient"),
    [
        (urllib3.exceptions.NewConnectionError(None, "refused"), True),
        (urllib3.exceptions.ReadTimeoutError(None, "/", "timed out"), True),
        (urllib3.exceptions.ProtocolError("IncompleteRead"), True),
        (urllib3.exceptions.SSLError("certificate verify failed"), False),
        (ConnectionResetError(), True),
        (ServerError("boom", 502), True),
        (ServerError("teapot", 418), False),
        (_s3_error("SlowDown", 503), True),
        (_s3_error("InternalError", 500), True),
        (_s3_error("RequestTimeout", 400), True),
        (_s3_error("NoSuchKey", 404), False),
        (_s3_error("AccessDenied", 403), False),
        (_s3_error("ConditionalRequestConflict", 409), True),  # a conditional write racing another
        (_s3_error("PreconditionFailed", 412), False),  # create's "the key is taken": an answer
        (_s3_error("NotImplemented", 501), False),  # an endpoint without the feature never gains it
        (ServerError("not implemented", 501), False),
        (ValueError("bug"), False),
    ],
)
def test_s3_transient_classification(exc: BaseException, transient: bool) -> None:
    assert is_transient(exc) is transient


# ---- retry policy ----


class FakeTime:
    """A clock that only moves when the code under test sleeps."""

    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.sleeps.append(seconds)
        self.now += seconds


class Flaky:
    """Fails with `error` the first `failures` calls, then returns 'ok'."""

    def __init__(self, failures: int, error: type[Exception] = ConnectionError) -> None:
        self.failures, self.error, self.calls = failures, error, 0

    def __call__(self) -> str:
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error(f"failure {self.calls}")
        return "ok"


def _transient(exc: BaseException) -> bool:
    return isinstance(exc, ConnectionError)


def test_retry_succeeds_after_transient_failures_within_backoff_bounds() -> None:
    t, fn = FakeTime(), Flaky(failures=4)
    policy = RetryPolicy(max_attempts=8, base_delay=0.2, max_delay=1.0, deadline=60)
    seen: list[tuple[int, float]] = []
    result = call_with_retry(
        fn,
        policy,
        is_transient=_transient,
        on_retry=lambda n, exc, delay: seen.append((n, delay)),
        sleep=t.sleep,
        clock=t.clock,
        rng=random.Random(7),
    )
    assert result == "ok" and fn.calls == 5
    assert [n for n, _ in seen] == [1, 2, 3, 4]
    assert [d for _, d in seen] == t.sleeps
    for n, delay in seen:  # full jitter: uniform in [0, min(max_delay, base * 2**(n-1))]
        assert 0 <= delay <= min(1.0, 0.2 * 2 ** (n - 1))


def test_retry_bound_caps_at_max_delay() -> None:
    policy = RetryPolicy(base_delay=0.2, max_delay=5.0)
    assert [policy.backoff_bound(n) for n in (1, 2, 3, 6, 7, 30)] == [0.2, 0.4, 0.8, 5.0, 5.0, 5.0]


def test_retry_jitter_is_seedable_and_spread() -> None:
    def delays(seed: int) -> list[float]:
        t = FakeTime()
        with pytest.raises(StoreUnavailable):
            call_with_retry(Flaky(99), RetryPolicy(max_attempts=6, deadline=1e9), is_transient=_transient,
                            sleep=t.sleep, clock=t.clock, rng=random.Random(seed))  # fmt: skip
        return t.sleeps

    assert delays(1) == delays(1)
    assert delays(1) != delays(2)


def test_retry_stops_at_max_attempts_with_cause() -> None:
    t, fn = FakeTime(), Flaky(failures=100)
    with pytest.raises(StoreUnavailable, match="3 attempt") as info:
        call_with_retry(
            fn, RetryPolicy(max_attempts=3), is_transient=_transient, sleep=t.sleep, clock=t.clock
        )
    assert fn.calls == 3 and len(t.sleeps) == 2
    assert isinstance(info.value.__cause__, ConnectionError)
    assert str(info.value.__cause__) == "failure 3"


def test_retry_stops_at_deadline() -> None:
    t, fn = FakeTime(), Flaky(failures=10_000)
    policy = RetryPolicy(max_attempts=10_000, base_delay=1.0, max_delay=1.0, deadline=10.0)
    with pytest.raises(StoreUnavailable):
        call_with_retry(
            fn, policy, is_transient=_transient, sleep=t.sleep, clock=t.clock, rng=random.Random(0)
        )
    assert t.now - 100.0 <= 10.0 + 1e-9  # never sleeps past the deadline
    assert fn.calls >= 10  # ...but keeps trying until it is reached


def test_retry_non_transient_propagates_at_once() -> None:
    t, fn = FakeTime(), Flaky(failures=5, error=KeyError)
    with pytest.raises(KeyError):
        call_with_retry(fn, RetryPolicy(), is_transient=_transient, sleep=t.sleep, clock=t.clock)
    assert fn.calls == 1 and t.sleeps == []
    with pytest.raises(NotFound):
        call_with_retry(lambda: (_ for _ in ()).throw(NotFound("k")), RetryPolicy(), is_transient=_transient)


def test_retry_single_attempt_policy_never_sleeps() -> None:
    t = FakeTime()
    with pytest.raises(StoreUnavailable):
        call_with_retry(
            Flaky(1), RetryPolicy(max_attempts=1), is_transient=_transient, sleep=t.sleep, clock=t.clock
        )
    assert t.sleeps == []


@pytest.mark.parametrize(
    "kwargs",
    [{"max_attempts": 0}, {"base_delay": -1}, {"base_delay": 2, "max_delay": 1}, {"deadline": -1}],
)
def test_retry_policy_validates(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        RetryPolicy(**kwargs)  # type: ignore[arg-type]


def test_file_put_survives_a_prune_racing_its_mkdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The syncer's delete prunes empty directories; a learner's mkdir can see the directory exist and then
    # vanish before it checks it (FileExistsError). That is a race to retry, not "a parent is an object".
    store = FileStore(tmp_path)
    real_mkdir, calls = Path.mkdir, []

    def racing_mkdir(self: Path, *args, **kwargs) -> None:
        calls.append(self)
        if len(calls) == 1:
            raise FileExistsError(str(self))
        real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", racing_mkdir)
    store.put("updates/000/00000120/000-0001.safetensors", b"x")
    assert store.get("updates/000/00000120/000-0001.safetensors") == b"x" and len(calls) >= 2


def test_file_put_under_an_object_says_so(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    store.put("a/b", b"object")
    with pytest.raises(StoreError, match="a parent of it is an object"):
        store.put("a/b/c", b"x")
