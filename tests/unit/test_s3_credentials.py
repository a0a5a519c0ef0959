"""The S3 store's credentials chain (ddiloco/store/s3_settings.py, s3_credentials.py): static keys first, else a
web-identity token exchanged at STS (a stand-in STS on loopback: the `AssumeRoleWithWebIdentity` query and
its XML answer, as AWS STS and minio's WebIdentityProvider speak them), container credentials, the instance's
role on an AWS endpoint; else one line naming everything tried."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import pytest

from ddiloco.store.base import StoreConfigError
from ddiloco.store.s3_credentials import ChainProvider
from ddiloco.store.s3_settings import S3Settings

ENDPOINT = {"DDILOCO_S3_ENDPOINT": "seaweedfs.kubeflow:9000"}
ANSWER = """<AssumeRoleWithWebIdentityResponse xmlns="https://sts.amazonaws.com/doc/2011-06-15/">
<AssumeRoleWithWebIdentityResult><Credentials><AccessKeyId>ASIATEMP</AccessKeyId>
<SecretAccessKey>temp-secret</SecretAccessKey><SessionToken>temp-token</SessionToken>
<Expiration>2999-01-01T00:00:00Z</Expiration></Credentials></AssumeRoleWithWebIdentityResult>
</AssumeRoleWithWebIdentityResponse>"""


@pytest.fixture
def sts():
    """A stand-in STS: answers AssumeRoleWithWebIdentity with fixed temporary keys; records the queries."""
    seen: list[dict[str, str]] = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_POST(self):
            query = {k: v[0] for k, v in parse_qs(urlsplit(self.path).query).items()}
            seen.append(query)
            ok = query.get("Action") == "AssumeRoleWithWebIdentity" and query.get("WebIdentityToken")
            body = (ANSWER if ok else "<Error/>").encode()
            self.send_response(200 if ok else 403)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", seen
    server.shutdown()
    server.server_close()


def test_static_keys_win_over_the_chain(tmp_path):
    env = {**ENDPOINT, "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"}
    env["AWS_WEB_IDENTITY_TOKEN_FILE"] = str(tmp_path / "token")
    s = S3Settings.from_env(env)
    assert (s.access_key, s.credentials_from, s.chain_env) == ("k", "AWS_ACCESS_KEY_ID", None)


def test_without_any_source_one_line_names_everything_tried():
    with pytest.raises(StoreConfigError) as e:
        S3Settings.from_env(ENDPOINT)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("no S3 credentials configured: set DDILOCO_S3_ACCESS_KEY")
    for tried in (
        "DDILOCO_S3_ACCESS_KEY / DDILOCO_S3_SECRET_KEY",
        "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY",
        "AWS_WEB_IDENTITY_TOKEN_FILE (unset)",
        "AWS_CONTAINER_CREDENTIALS_FULL_URI",
        "instance metadata (not tried: seaweedfs.kubeflow is no AWS endpoint)",
    ):
        assert tried in msg, (tried, msg)


def test_an_aws_endpoint_tries_the_instance_role_unless_metadata_is_disabled():
    env = {"DDILOCO_S3_ENDPOINT": "https://s3.eu-west-1.amazonaws.com"}
    assert "instance's role" in S3Settings.from_env(env).credentials_from
    with pytest.raises(StoreConfigError, match="AWS_EC2_METADATA_DISABLED=true"):
        S3Settings.from_env({**env, "AWS_EC2_METADATA_DISABLED": "true"})


def test_web_identity_token_file_is_exchanged_at_sts_for_temporary_keys(tmp_path, sts, monkeypatch):
    url, seen = sts
    for var in ("AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_ROLE_ARN", "AWS_CONTAINER_CREDENTIALS_FULL_URI"):
        monkeypatch.delenv(var, raising=False)  # minio reads the process environment first
    token = tmp_path / "token"
    token.write_text("eyJ.projected-service-account-token.sig")
    env = {**ENDPOINT, "AWS_WEB_IDENTITY_TOKEN_FILE": str(token), "AWS_ROLE_ARN": "arn:aws:iam::1:role/r"}
    settings = S3Settings.from_env({**env, "AWS_ENDPOINT_URL_STS": url})
    assert settings.credentials_from.startswith("the AWS credential chain: a web-identity token")
    assert settings.chain_env is not None and settings.access_key == ""
    creds = ChainProvider(settings.chain_env, "a web-identity token").retrieve()
    assert (creds.access_key, creds.secret_key, creds.session_token) == (
        "ASIATEMP",
        "temp-secret",
        "temp-token",
    )
    (query,) = seen
    assert query["WebIdentityToken"] == token.read_text() and query["RoleArn"] == "arn:aws:iam::1:role/r"


def test_a_failing_chain_is_one_line_naming_its_source(tmp_path, sts, monkeypatch):
    url, _ = sts
    monkeypatch.delenv("AWS_WEB_IDENTITY_TOKEN_FILE", raising=False)
    env = {**ENDPOINT, "AWS_WEB_IDENTITY_TOKEN_FILE": str(tmp_path / "missing"), "AWS_ENDPOINT_URL_STS": url}
    settings = S3Settings.from_env(env)
    with pytest.raises(StoreConfigError) as e:
        ChainProvider(settings.chain_env, "a web-identity token").retrieve()
    assert "\n" not in str(e.value) and str(e.value).startswith("no S3 credentials from a web-identity token")


def test_the_store_signs_with_the_chains_keys(tmp_path, sts, monkeypatch):
    from ddiloco.store.s3 import S3Store

    url, _ = sts
    monkeypatch.delenv("AWS_WEB_IDENTITY_TOKEN_FILE", raising=False)
    token = tmp_path / "token"
    token.write_text("jwt")
    env = {**ENDPOINT, "AWS_WEB_IDENTITY_TOKEN_FILE": str(token), "AWS_ENDPOINT_URL_STS": url}
    store = S3Store("bucket", settings=S3Settings.from_env(env))
    assert store._conn.client._provider.retrieve().access_key == "ASIATEMP"
