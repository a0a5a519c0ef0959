"""The S3 store's credentials when no static keys are set: the standard AWS chain after the keys in the
environment (`s3_settings.CREDENTIAL_VARS`): a web-identity token file (EKS IRSA, `AWS_WEB_IDENTITY_TOKEN_FILE`
+ `AWS_ROLE_ARN`, exchanged at STS `AssumeRoleWithWebIdentity`), container credentials (EKS Pod Identity /
ECS, `AWS_CONTAINER_CREDENTIALS_FULL_URI` or `_RELATIVE_URI`; minio reads `AWS_CONTAINER_AUTHORIZATION_TOKEN
[_FILE]` from the process environment itself),
and the instance's role (EC2 instance metadata, IMDSv2).

Design choices:
- minio's `IamAwsProvider` does the fetching and refreshes before expiry (minio/credentials/providers.py; it
  takes the first of web identity, relative URI, full URI, instance metadata that is configured); this
  module decides whether the chain applies and names what was tried when it fails, in one line.
- Instance metadata is tried only for an AWS S3 endpoint (`*.amazonaws.com`), and never with
  `AWS_EC2_METADATA_DISABLED=true`: elsewhere 169.254.169.254 is someone else's or nobody's, and a run would
  wait on it instead of saying which keys to set.
- The STS endpoint is AWS's regional one unless `AWS_ENDPOINT_URL_STS` names another (the AWS SDKs'
  service-specific endpoint variable): an S3-compatible store with an STS of its own, or a test's stand-in.
- GCS through its S3-compatible endpoint (storage.googleapis.com) takes HMAC keys as static keys; GKE Workload
  Identity has no S3-style token exchange (docs/cluster.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from urllib.parse import urlsplit

import urllib3
from minio.credentials import Credentials, IamAwsProvider, Provider

from ddiloco.store.base import StoreConfigError

WEB_IDENTITY = ("AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_ROLE_ARN")
CONTAINER = ("AWS_CONTAINER_CREDENTIALS_FULL_URI", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI")


def _set(env: Mapping[str, str], name: str) -> str:
    return env.get(name, "").strip()


def chain_source(env: Mapping[str, str], endpoint: str) -> str:
    """Which link of the chain applies ("" when none does)."""
    if _set(env, WEB_IDENTITY[0]):
        return f"a web-identity token ({WEB_IDENTITY[0]}={_set(env, WEB_IDENTITY[0])})"
    for name in CONTAINER:
        if _set(env, name):
            return f"container credentials ({name}={_set(env, name)})"
    host = urlsplit(f"//{endpoint}").hostname or ""
    metadata_off = _set(env, "AWS_EC2_METADATA_DISABLED").lower() == "true"
    if host.endswith((".amazonaws.com", ".amazonaws.com.cn")) and not metadata_off:
        return "the instance's role (EC2 instance metadata)"
    return ""


def nothing_found(static_vars: list[str], env: Mapping[str, str], endpoint: str) -> StoreConfigError:
    """The one-line error when no credentials source applies, naming every one tried."""
    host = urlsplit(f"//{endpoint}").hostname or ""
    metadata = (
        "instance metadata (AWS_EC2_METADATA_DISABLED=true)"
        if _set(env, "AWS_EC2_METADATA_DISABLED").lower() == "true"
        else f"instance metadata (not tried: {host} is no AWS endpoint)"
    )
    tried = [*static_vars, f"{WEB_IDENTITY[0]} (unset)", f"{' / '.join(CONTAINER)} (unset)", metadata]
    return StoreConfigError(
        "no S3 credentials configured: set DDILOCO_S3_ACCESS_KEY and DDILOCO_S3_SECRET_KEY (or "
        f"AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY); tried {', '.join(tried)}"
    )


class ChainProvider(Provider):
    """minio's IamAwsProvider for `env`, its failures as one StoreConfigError naming the source."""

    def __init__(self, env: Mapping[str, str], source: str) -> None:
        http = urllib3.PoolManager(
            timeout=urllib3.Timeout(connect=3.0, read=10.0),
            retries=urllib3.Retry(total=2, backoff_factor=0.2, status_forcelist=[500, 502, 503, 504]),
        )
        sts = _set(env, "AWS_ENDPOINT_URL_STS") if _set(env, WEB_IDENTITY[0]) else ""
        self.source = source
        self._iam = IamAwsProvider(
            custom_endpoint=sts or None,
            http_client=http,
            token_file=_set(env, WEB_IDENTITY[0]) or None,
            role_arn=_set(env, WEB_IDENTITY[1]) or None,
            role_session_name=_set(env, "AWS_ROLE_SESSION_NAME") or None,
            relative_uri=_set(env, CONTAINER[1]) or None,
            full_uri=_set(env, CONTAINER[0]) or None,
            region=_set(env, "AWS_REGION") or _set(env, "AWS_DEFAULT_REGION") or None,
        )

    def retrieve(self) -> Credentials:
        try:
            return self._iam.retrieve()
        except Exception as exc:  # noqa: BLE001 (any failure of the fetch is the same configuration problem)
            one_line = " ".join(str(exc).split())
            raise StoreConfigError(f"no S3 credentials from {self.source}: {one_line}") from exc
