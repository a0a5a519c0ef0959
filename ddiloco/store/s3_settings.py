"""Where and how to reach an S3 endpoint (`S3Settings`): endpoint, credentials, region and TLS, from the
environment; `ddiloco.store.s3` uses it (its module docstring says why the region is always set). Credentials:
static keys (`CREDENTIAL_VARS`, first pair set), else the rest of the AWS chain (`s3_credentials`: web
identity, container credentials, instance role), else one error naming everything tried."""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from collections.abc import Mapping
from urllib.parse import urlsplit

from ddiloco.store.base import StoreConfigError
from ddiloco.store.s3_credentials import chain_source, nothing_found

logger = logging.getLogger(__name__)

__all__ = ["S3Settings", "bad_endpoint"]

ENDPOINT_VARS = ("DDILOCO_S3_ENDPOINT", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "S3_ENDPOINT")
CREDENTIAL_VARS = (
    ("DDILOCO_S3_ACCESS_KEY", "DDILOCO_S3_SECRET_KEY"),
    ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"),
    ("MINIO_ACCESS_KEY", "MINIO_SECRET_KEY"),
)

REGION_VARS = ("DDILOCO_S3_REGION", "AWS_REGION", "AWS_DEFAULT_REGION")
DEFAULT_REGION = "us-east-1"
AUTO_REGION = "auto"
"""DDILOCO_S3_REGION=auto: let minio ask the bucket (GetBucketLocation, a bucket-level read)."""


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


@dataclasses.dataclass(frozen=True, kw_only=True)
class S3Settings:
    """Where and how to reach the S3 endpoint."""

    endpoint: str
    """host:port (no scheme)."""
    access_key: str
    secret_key: str = dataclasses.field(repr=False)
    session_token: str | None = dataclasses.field(default=None, repr=False)
    secure: bool = False
    region: str | None = None
    """The signing region; None: us-east-1, or on an AWS host what minio finds; "auto": ask the bucket."""
    ca_bundle: str | None = None
    connect_timeout: float = 5.0
    read_timeout: float = 30.0
    credentials_from: str = "arguments"
    """Which variable the credentials came from, for error messages."""
    chain_env: Mapping[str, str] | None = dataclasses.field(default=None, repr=False)
    """Set (the environment) when no static keys are: the AWS credential chain (`s3_credentials`)."""

    @property
    def endpoint_url(self) -> str:
        return f"{'https' if self.secure else 'http'}://{self.endpoint}"

    @property
    def client_region(self) -> str | None:
        """The region the minio client is given; None only where it must find it itself."""
        if (self.region or "").lower() == AUTO_REGION:
            return None
        if self.region:
            return self.region
        host = urlsplit(f"//{self.endpoint}").hostname or ""
        return None if host.endswith((".amazonaws.com", ".amazonaws.com.cn")) else DEFAULT_REGION

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> S3Settings:
        """Read the endpoint, credentials and TLS settings; StoreConfigError names what is missing."""
        env = os.environ if env is None else env
        raw = next((env[v].strip() for v in ENDPOINT_VARS if env.get(v, "").strip()), "")
        if not raw:
            raise StoreConfigError(
                "no S3 endpoint configured: set DDILOCO_S3_ENDPOINT (host:port or http(s)://host:port; "
                "AWS_ENDPOINT_URL and S3_ENDPOINT are also read)"
            )
        endpoint, secure = _parse_endpoint(raw, _truthy(env.get("DDILOCO_S3_SECURE")))
        chain_env: Mapping[str, str] | None = None
        for access_var, secret_var in CREDENTIAL_VARS:
            access = env.get(access_var, "").strip()
            if not access:
                continue
            secret = env.get(secret_var, "").strip()
            if not secret:
                raise StoreConfigError(f"{access_var} is set but {secret_var} is not: set both")
            break
        else:  # no static keys: the rest of the standard chain, if any link of it applies
            source = chain_source(env, endpoint)
            if not source:
                raise nothing_found([f"{a} / {s}" for a, s in CREDENTIAL_VARS], env, endpoint)
            access, secret, access_var, chain_env = "", "", f"the AWS credential chain: {source}", dict(env)
        ca_bundle = env.get("DDILOCO_S3_CA_BUNDLE") or None
        if ca_bundle is not None and not os.path.isfile(ca_bundle):
            raise StoreConfigError(
                f"DDILOCO_S3_CA_BUNDLE={ca_bundle} is not a file: point it at a PEM CA bundle"
            )
        return cls(
            endpoint=endpoint,
            access_key=access,
            secret_key=secret,
            session_token=env.get("AWS_SESSION_TOKEN") or None,
            secure=secure,
            region=next((env[v].strip() for v in REGION_VARS if env.get(v, "").strip()), None),
            ca_bundle=ca_bundle,
            credentials_from=access_var,
            chain_env=chain_env,
        )


def bad_endpoint(raw: str, why: str = "") -> StoreConfigError:
    return StoreConfigError(
        f"bad S3 endpoint {raw!r}{f' ({why})' if why else ''}: use host:port or http(s)://host:port (no path) "
        f"in DDILOCO_S3_ENDPOINT"
    )


_HOST_PORT = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+)(:[0-9]{1,5})?$")


def _parse_endpoint(raw: str, secure_flag: bool) -> tuple[str, bool]:
    endpoint, secure = _split_endpoint(raw, secure_flag)
    # Checked here, not left to the HTTP client: how a malformed host fails differs between urllib3 versions.
    if not _HOST_PORT.match(endpoint):
        raise bad_endpoint(raw, "not a host[:port]")
    return endpoint, secure


def _split_endpoint(raw: str, secure_flag: bool) -> tuple[str, bool]:
    if "://" not in raw:
        return raw.rstrip("/"), secure_flag
    try:
        parts = urlsplit(raw)
        _ = parts.port  # raises ValueError on a bad port
    except ValueError as exc:
        raise bad_endpoint(raw, str(exc)) from exc
    if parts.scheme not in ("http", "https") or not parts.netloc or parts.path not in ("", "/"):
        raise bad_endpoint(raw)
    if secure_flag and parts.scheme == "http":
        logger.warning("DDILOCO_S3_SECURE is set but the endpoint %s says http://: using plain http", raw)
    return parts.netloc, parts.scheme == "https"
