"""A stand-in for AWS STS `AssumeRoleWithWebIdentity` on 127.0.0.1, in front of a SeaweedFS test server: it
accepts a web-identity token it was given for a role and hands out that SeaweedFS's own keys as the role's
temporary credentials. Nothing else of STS (no JWT signature or audience check, no policies, no other
actions); it is no SeaweedFS feature either.

Why a stand-in: SeaweedFS 4.x has an STS of its own (`weed s3 -iam.config`, an advanced IAM configuration
with OIDC providers), but it validates the token as a JWT against an OIDC issuer's JWKS; standing up an issuer
for the tests is more machinery than the client side needs, and the client side (minio's
WebIdentityProvider through `ddiloco.store.s3_credentials`) is what these tests are about.

The shape is AWS's (STS API reference, AssumeRoleWithWebIdentity): a POST whose query holds
`Action=AssumeRoleWithWebIdentity`, `RoleArn`, `RoleSessionName`, `WebIdentityToken` (minio puts them in the
query string), answered with `AssumeRoleWithWebIdentityResponse/AssumeRoleWithWebIdentityResult/Credentials`
(`AccessKeyId`, `SecretAccessKey`, `SessionToken`, `Expiration`), or an `ErrorResponse` with code
`InvalidIdentityToken` / `AccessDenied` and HTTP 400 / 403.
"""

from __future__ import annotations

import datetime
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit
from xml.sax.saxutils import escape

NS = "https://sts.amazonaws.com/doc/2011-06-15/"


def _answer(access: str, secret: str, token: str, expires: datetime.datetime) -> str:
    stamp = expires.strftime("%Y-%m-%dT%H:%M:%SZ")
    return (
        f'<AssumeRoleWithWebIdentityResponse xmlns="{NS}"><AssumeRoleWithWebIdentityResult><Credentials>'
        f"<AccessKeyId>{escape(access)}</AccessKeyId><SecretAccessKey>{escape(secret)}</SecretAccessKey>"
        f"<SessionToken>{escape(token)}</SessionToken><Expiration>{stamp}</Expiration>"
        "</Credentials></AssumeRoleWithWebIdentityResult></AssumeRoleWithWebIdentityResponse>"
    )


def _error(code: str, message: str) -> str:
    return (
        f'<ErrorResponse xmlns="{NS}"><Error><Type>Sender</Type><Code>{code}</Code>'
        f"<Message>{escape(message)}</Message></Error></ErrorResponse>"
    )


@dataclass
class StsStandIn:
    """`roles`: role ARN -> the one token it accepts; every accepted call gets `access`/`secret`."""

    access: str
    secret: str
    roles: dict[str, str]
    session_token: str = ""
    """Sent as SessionToken. AWS always sends one; empty by default, because SeaweedFS refuses a request that
    carries a session token it did not issue itself (AccessDenied on the bucket check, seen with weed 4.48),
    and with an empty one minio signs without X-Amz-Security-Token."""
    seen: list[dict[str, str]] = field(default_factory=list)
    _server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def reply(self, query: dict[str, str]) -> tuple[int, str]:
        self.seen.append({k: v for k, v in query.items() if k != "WebIdentityToken"})
        if query.get("Action") != "AssumeRoleWithWebIdentity":
            return 400, _error("InvalidAction", f"not served by the stand-in: {query.get('Action')}")
        role = query.get("RoleArn", "")
        if role not in self.roles:
            return 403, _error(
                "AccessDenied", f"Not authorized to perform sts:AssumeRoleWithWebIdentity {role}"
            )
        if query.get("WebIdentityToken") != self.roles[role]:
            return 400, _error(
                "InvalidIdentityToken", "Couldn't retrieve verification key from your identity"
            )
        expires = datetime.datetime.now(datetime.UTC) + datetime.timedelta(hours=1)
        return 200, _answer(self.access, self.secret, self.session_token, expires)

    def start(self) -> StsStandIn:
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length).decode() if length else ""
                query = {k: v[0] for k, v in parse_qs(urlsplit(self.path).query).items()}
                query.update({k: v[0] for k, v in parse_qs(body).items()})
                status, text = stand_in.reply(query)
                data = text.encode()
                self.send_response(status)
                self.send_header("Content-Type", "text/xml")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
