"""Run keys and payload signatures: HMAC-SHA256 so that only holders of the run's key can publish.

Design choices:
- The secret never lives in the store. It comes from the environment variable `DDILOCO_RUN_KEY` (hex, at
  least 16 bytes), which a Kubernetes Secret maps into the prepare, learner and syncer pods; `ddiloco run`
  generates one per run and keeps it in `{workdir}/{run_id}.key` (mode 0600) next to the logs.
- That variable holds a *master* key. Every run signs with its own key `HMAC(master, "ddiloco-run-key\\0" +
  run_id)`, so one Secret can serve every run of a namespace and an object copied from another run never
  verifies, whatever its header claims.
- A signature covers the canonical JSON of the payload header (sorted keys, no spaces, ASCII), which holds
  the SHA-256 of the data region and of the safetensors tensor table (`wire.pack` adds both), so header,
  tensor layout and bytes are all authenticated by one MAC. Verification recomputes the canonical form
  from the parsed header and compares in constant time (`hmac.compare_digest`).
- `key_id` (a short hash of the run key, safe to log) goes into the header too, so a rejection can tell
  "signed with another key" apart from "content altered after signing"; both count as `bad_signature`.
- Without a key the roles run unsigned (a warning, once per process): in-process tests and quick local
  experiments keep working, and nothing pretends to be authenticated.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ddiloco.errors import ConfigError

log = logging.getLogger(__name__)

ENV_VAR = "DDILOCO_RUN_KEY"
MIN_KEY_BYTES = 16
MAC_FIELD = "mac"
KEY_ID_FIELD = "key_id"
_warned: set[str] = set()


def parse_key(text: str, source: str = ENV_VAR) -> bytes:
    """Decode a hex master key; ConfigError (one line, what to do) if it is not usable."""
    text = text.strip()
    try:
        key = bytes.fromhex(text)
    except ValueError:
        raise ConfigError(f"{source} is not a hex string; generate one with `openssl rand -hex 32`") from None
    if len(key) < MIN_KEY_BYTES:
        raise ConfigError(
            f"{source} holds {len(key)} bytes; use at least {MIN_KEY_BYTES} (`openssl rand -hex 32`)"
        )
    return key


def key_from_env(env: Mapping[str, str] | None = None) -> bytes | None:
    """The master key from `DDILOCO_RUN_KEY`, or None when it is unset or empty (unsigned mode)."""
    raw = (os.environ if env is None else env).get(ENV_VAR, "")
    return parse_key(raw) if raw.strip() else None


def generate_key() -> str:
    """A fresh random master key as hex (32 bytes)."""
    return secrets.token_hex(32)


def ensure_key_file(path: str | Path) -> str:
    """Return the hex key stored at `path`, creating it (mode 0600, never overwritten) if it is missing."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        text = path.read_text().strip()
        parse_key(text, str(path))
        return text
    text = generate_key()
    with os.fdopen(fd, "w") as f:
        f.write(text + "\n")
    return text


def for_run(master: bytes | None, run_id: str) -> bytes | None:
    """The run's signing key derived from the master key (None stays None: unsigned)."""
    if master is None:
        return None
    return hmac.new(master, b"ddiloco-run-key\0" + run_id.encode(), hashlib.sha256).digest()


def key_id(key: bytes) -> str:
    """A short, non-secret fingerprint of a run key (for logs and rejection messages)."""
    return hashlib.sha256(b"ddiloco-key-id\0" + key).hexdigest()[:12]


def canonical(meta: Mapping[str, Any]) -> bytes:
    """The bytes a MAC covers: the header without its MAC, as canonical JSON."""
    body = {k: v for k, v in meta.items() if k != MAC_FIELD}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def sign(meta: Mapping[str, Any], key: bytes) -> str:
    """HMAC-SHA256 (hex) of the canonical header."""
    return hmac.new(key, b"ddiloco-payload\0" + canonical(meta), hashlib.sha256).hexdigest()


def check(meta: Mapping[str, Any], key: bytes) -> str | None:
    """None if `meta` carries a valid MAC under `key`; else the rejection reason and why, as 'reason: why'."""
    mac = meta.get(MAC_FIELD)
    if mac is None:
        return "unsigned: the payload carries no signature"
    if not isinstance(mac, str) or not hmac.compare_digest(mac.encode(), sign(meta, key).encode()):
        theirs, ours = meta.get(KEY_ID_FIELD), key_id(key)
        if theirs != ours:
            return f"bad_signature: signed with another key (key id {theirs!r}, this run's is {ours!r})"
        return "bad_signature: the signature does not match the content (altered after signing)"
    return None


def warn_unsigned(role: str) -> None:
    """Log once per process and role that this role neither signs nor verifies."""
    if role not in _warned:
        _warned.add(role)
        log.warning(
            "%s: %s is not set; updates and global versions are neither signed nor verified "
            "(set it from a Kubernetes Secret, e.g. `openssl rand -hex 32`)",
            role,
            ENV_VAR,
        )
