"""Run keys and signatures: only a learner of the run can answer, and only its syncer can publish.

The secret never lives in the store: the master key comes from `DDILOCO_RUN_KEY` in the prepare, syncer and
post-training pods, and learner pods get only their share (`DDILOCO_LEARNER_KEY`, `DDILOCO_SYNCER_PUBKEY`;
`ddiloco keys` prints them). Learners sign with an HMAC key per run, the syncer with Ed25519, which learners
can verify but not forge (`ddiloco.protocol.rolekeys`); a payload's `kind` says which role must have signed
it (`role_of`). A signature covers the canonical JSON of a header or document and the run id. `key_id` tells
"another key" from "altered after signing". Without a key the roles run unsigned, with one warning per
process, so local experiments work and nothing pretends to be authenticated.

Design notes: docs/internals.md, "Keys and signatures"; the threat model: docs/operations.md.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddiloco.errors import ConfigError
from ddiloco.protocol import rolekeys

log = logging.getLogger(__name__)

ENV_VAR = "DDILOCO_RUN_KEY"
LEARNER_KEY_VAR = "DDILOCO_LEARNER_KEY"
"""A learner pod's share of the key (`rolekeys.learner_master`; `ddiloco keys` prints it)."""
SYNCER_PUBKEY_VAR = "DDILOCO_SYNCER_PUBKEY"
"""The syncer's public key (hex), given to learner pods with `LEARNER_KEY_VAR`."""
MIN_KEY_BYTES = 16
MAC_FIELD = "mac"
SIG_FIELD = "sig"
KEY_ID_FIELD = "key_id"
LEARNER, SYNCER = "learner", "syncer"
LEARNER_KINDS = frozenset({"update", "learner_ckpt"})
"""Payload kinds learners write (signed with the learner key); every other kind is the syncer's."""
_warned: set[str] = set()


@dataclass(frozen=True, slots=True)
class LearnerShare:
    """What a learner pod holds instead of the master key: the learner master and the syncer's public key."""

    learner: bytes = field(repr=False)
    public: bytes


@dataclass(frozen=True, slots=True)
class RunKeys:
    """One run's keys as this process holds them: the learners' HMAC key, the syncer's public key and,
    for the roles that hold the master key only, the syncer's private seed (`rolekeys`)."""

    run_id: str
    learner: bytes = field(repr=False)
    public: bytes
    seed: bytes | None = field(default=None, repr=False)

    def seed_for(self, kind: Any) -> bytes:
        """The syncer's seed, to sign `kind`; a learner's keys cannot (ValueError)."""
        if self.seed is None:
            raise ValueError(f"a learner's keys cannot sign {str(kind)[:40]!r}: only the syncer's key can")
        return self.seed

    def learner_only(self) -> RunKeys:
        """These keys without the syncer's seed: what a learner process keeps."""
        return RunKeys(self.run_id, self.learner, self.public)


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


def key_from_env(env: Mapping[str, str] | None = None) -> bytes | LearnerShare | None:
    """The master key from `DDILOCO_RUN_KEY`; else a learner's share from `DDILOCO_LEARNER_KEY` and
    `DDILOCO_SYNCER_PUBKEY` (both or neither); None when none is set (unsigned mode)."""
    env = os.environ if env is None else env
    raw = env.get(ENV_VAR, "")
    if raw.strip():
        return parse_key(raw)
    learner, public = env.get(LEARNER_KEY_VAR, "").strip(), env.get(SYNCER_PUBKEY_VAR, "").strip()
    if not (learner or public):
        return None
    if not (learner and public):
        missing = SYNCER_PUBKEY_VAR if learner else LEARNER_KEY_VAR
        raise ConfigError(f"{missing} is not set: a learner needs both (`ddiloco keys` prints them)")
    pub = parse_key(public, SYNCER_PUBKEY_VAR)
    if len(pub) != 32:
        raise ConfigError(f"{SYNCER_PUBKEY_VAR} holds {len(pub)} bytes, an Ed25519 key 32 (`ddiloco keys`)")
    return LearnerShare(parse_key(learner, LEARNER_KEY_VAR), pub)


def learner_env(master: bytes) -> dict[str, str]:
    """The environment a learner pod gets instead of the master key (`ddiloco keys` prints it)."""
    return {
        LEARNER_KEY_VAR: rolekeys.learner_master(master).hex(),
        SYNCER_PUBKEY_VAR: rolekeys.public_of(rolekeys.syncer_seed(master)).hex(),
    }


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


def for_run(secret: bytes | LearnerShare | None, run_id: str) -> RunKeys | None:
    """The run's keys from what this process holds (None stays None: unsigned): a master key gives every
    role's keys, a `LearnerShare` only a learner's (`rolekeys`)."""
    if secret is None:
        return None
    if isinstance(secret, LearnerShare):
        return RunKeys(run_id, rolekeys.learner_run_key(secret.learner, run_id), secret.public)
    learner = rolekeys.learner_run_key(rolekeys.learner_master(secret), run_id)
    seed = rolekeys.syncer_seed(secret)
    return RunKeys(run_id, learner, rolekeys.public_of(seed), seed)


def key_id(key: bytes) -> str:
    """A short, non-secret fingerprint of a key (for logs and rejection messages)."""
    return hashlib.sha256(b"ddiloco-key-id\0" + key).hexdigest()[:12]


def canonical(meta: Mapping[str, Any]) -> bytes:
    """The bytes a signature covers: the header without its MAC or signature, as canonical JSON."""
    body = {k: v for k, v in meta.items() if k not in (MAC_FIELD, SIG_FIELD)}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def role_of(kind: Any) -> str:
    """Who signs a payload of this `kind`: "learner" (updates, learner checkpoints) or "syncer" (anything
    else: global versions, shards, models; written by prepare, the syncer and post-training)."""
    return LEARNER if kind in LEARNER_KINDS else SYNCER


_PAYLOAD = b"ddiloco-payload\0"


def sign_payload(meta: dict[str, Any], keys: RunKeys) -> None:
    """Add `key_id` and the signature of the role `meta["kind"]` belongs to (`role_of`) to `meta`."""
    role = role_of(meta.get("kind"))
    meta[KEY_ID_FIELD] = _key_id_of(keys, role)  # covered by the signature
    meta.update(_sign(keys, role, _PAYLOAD + canonical(meta), meta.get("kind")))


def check_payload(meta: Mapping[str, Any], keys: RunKeys, role: str) -> str | None:
    """None if `meta` carries a valid signature of `role` under `keys`; else 'reason: why'."""
    return _verify(meta, keys, role, _PAYLOAD + canonical(meta))


# --- signed JSON documents (status, done, round records, learner reports) ----------------------------------
DOC_SIGNATURE = "signature"


def _doc_bytes(doc: Mapping[str, Any], run_id: str) -> bytes:
    body = {k: v for k, v in doc.items() if k != DOC_SIGNATURE}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return b"ddiloco-doc\0" + run_id.encode() + b"\0" + text.encode()


def sign_doc(doc: Mapping[str, Any], keys: RunKeys | None, role: str) -> dict[str, Any]:
    """`doc` with the signature of `role` (bound to the run id) under `DOC_SIGNATURE`; as it is unsigned."""
    out = {k: v for k, v in doc.items() if k != DOC_SIGNATURE}
    if keys is not None:
        signed = _sign(keys, role, _doc_bytes(out, keys.run_id), "a document")
        out[DOC_SIGNATURE] = {"role": role, KEY_ID_FIELD: _key_id_of(keys, role), **signed}
    return out


def check_doc(doc: Any, keys: RunKeys | None, role: str) -> str | None:
    """None if `doc` is signed by `role` of this run (or `keys` is None: unsigned run); else 'reason: why'."""
    if keys is None:
        return None
    if not isinstance(doc, Mapping):
        return "malformed: not a JSON object"
    sig = doc.get(DOC_SIGNATURE)
    if not isinstance(sig, Mapping):
        return f"unsigned: it carries no signature (the {role}'s is required)"
    return _verify(sig, keys, role, _doc_bytes(doc, keys.run_id))


# --- one role's signature: an HMAC for learners, Ed25519 for the syncer --------------------------------------
def _key_id_of(keys: RunKeys, role: str) -> str:
    return key_id(keys.learner if role == LEARNER else keys.public)


def _sign(keys: RunKeys, role: str, data: bytes, what: Any) -> dict[str, str]:
    """The signature field of `role` over `data` (`what`: named when a learner's keys cannot sign it)."""
    if role == LEARNER:
        return {MAC_FIELD: _mac(keys.learner, data)}
    return {SIG_FIELD: rolekeys.sign(keys.seed_for(what), data)}


def _verify(fields: Mapping[str, Any], keys: RunKeys, role: str, data: bytes) -> str | None:
    """None if `fields` hold `role`'s valid signature over `data`; else 'reason: why'."""
    mac, sig = fields.get(MAC_FIELD), fields.get(SIG_FIELD)
    if role == LEARNER:
        if mac is None:
            if sig is not None:
                return "bad_signature: signed by the syncer's key where a learner's is expected"
            return "unsigned: it carries no signature (a learner's is required)"
        ok = isinstance(mac, str) and hmac.compare_digest(mac.encode(), _mac(keys.learner, data).encode())
    else:
        if sig is None:
            if mac is not None:
                return "bad_signature: signed with a learner's key where the syncer's signature is required"
            return "unsigned: it carries no signature (the syncer's is required)"
        ok = isinstance(sig, str) and rolekeys.verify(keys.public, data, sig)
    if ok:
        return None
    theirs, ours = fields.get(KEY_ID_FIELD), _key_id_of(keys, role)
    if theirs != ours:
        return f"bad_signature: signed with another key (key id {str(theirs)[:16]!r}, this run's is {ours!r})"
    return "bad_signature: the signature does not match the content (altered after signing)"


def _mac(key: bytes, data: bytes) -> str:
    return hmac.new(key, data, hashlib.sha256).hexdigest()


def warn_master_in_learner(role: str) -> None:
    """Log once that a learner process was given the master key (it only needs its share)."""
    if f"master:{role}" not in _warned:
        _warned.add(f"master:{role}")
        log.warning(
            "%s holds %s, the master key; it uses only a learner's keys, but give learner pods %s and %s "
            "instead (`ddiloco keys`) so a compromised learner cannot sign as the syncer",
            role,
            ENV_VAR,
            LEARNER_KEY_VAR,
            SYNCER_PUBKEY_VAR,
        )


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
