"""The S3 store's credentials when no static keys are set: the standard AWS chain after the keys in the
environment (`s3_settings.CREDENTIAL_VARS`): a web-identity token file (EKS IRSA), container credentials
(EKS Pod Identity / ECS) and the instance's role (EC2 instance metadata, IMDSv2).

minio's `IamAwsProvider` fetches and refreshes them; this module decides whether the chain applies and,
when it fails, names in one line what was tried. Instance metadata is tried only for an AWS S3 endpoint and
never with `AWS_EC2_METADATA_DISABLED=true`, so a run elsewhere says which keys to set instead of waiting on
169.254.169.254. `AWS_ENDPOINT_URL_STS` may name another STS endpoint. GCS takes HMAC keys as static keys;
GKE Workload Identity has no S3-style token exchange (docs/cluster.md).

Design notes (the variables each source reads): docs/internals.md, "S3", "Credentials".
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
