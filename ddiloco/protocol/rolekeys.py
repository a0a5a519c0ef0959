"""Keys per role, derived from the run's master key: what a learner may sign and what only the syncer may.

- Learners sign updates, their checkpoints and reports with an HMAC key: per run,
  `HMAC(L, "ddiloco-run-key\\0" + run_id)`, where the learner master `L = HMAC(master, "ddiloco-learner-key\\0")`
  is all a learner pod is given (`DDILOCO_LEARNER_KEY`).
- The syncer (and prepare and post-training, which hold the master key) sign global versions, shards,
  models, status, the done marker and round records with Ed25519: the private key's seed is
  `HMAC(master, "ddiloco-syncer-seed\\0")`; learners hold its public key (`DDILOCO_SYNCER_PUBKEY`) and so can
  verify those objects but not forge them. HMAC for this role would not do: a key that verifies an HMAC
  also makes one. The public key is one per master key (a learner cannot derive a per-run one), so the run
  id is inside everything it signs (payload headers name it; documents are signed with it).
- Ed25519 through `cryptography` (OpenSSL): a signature over a payload's header (which holds the SHA-256 of
  the data) costs ~50 µs to make and ~100 µs to check.
"""

from __future__ import annotations

import hashlib
import hmac

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat


def learner_master(master: bytes) -> bytes:
    """The learners' share of the master key (what `DDILOCO_LEARNER_KEY` holds)."""
    return hmac.new(master, b"ddiloco-learner-key\0", hashlib.sha256).digest()


def learner_run_key(learner: bytes, run_id: str) -> bytes:
    """The HMAC key learners of run `run_id` sign with (and the syncer checks with)."""
    return hmac.new(learner, b"ddiloco-run-key\0" + run_id.encode(), hashlib.sha256).digest()


def syncer_seed(master: bytes) -> bytes:
    """The syncer's Ed25519 private key (its 32-byte seed), derived from the master key."""
    return hmac.new(master, b"ddiloco-syncer-seed\0", hashlib.sha256).digest()


def public_of(seed: bytes) -> bytes:
    """The raw 32-byte Ed25519 public key of a seed (what `DDILOCO_SYNCER_PUBKEY` holds)."""
    private = Ed25519PrivateKey.from_private_bytes(seed)
    return private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


def sign(seed: bytes, data: bytes) -> str:
    """The Ed25519 signature of `data` (hex)."""
    return Ed25519PrivateKey.from_private_bytes(seed).sign(data).hex()


def verify(public: bytes, data: bytes, signature: str) -> bool:
    """Whether `signature` (hex) is the syncer's over `data`."""
    try:
        Ed25519PublicKey.from_public_bytes(public).verify(bytes.fromhex(signature), data)
    except (InvalidSignature, ValueError):
        return False
    return True
