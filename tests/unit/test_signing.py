"""Run keys and payload signatures: what is accepted, what is refused, and under which reason."""

import json
import os
import stat
import struct

import pytest
import torch

from ddiloco.errors import ConfigError
from ddiloco.protocol import signing, wire

MASTER = bytes(range(32))
KEY = signing.for_run(MASTER, "run-a")
UPDATE = {"kind": "update"}


def _payload(key=KEY, **meta):
    tensors = {"w/data": torch.arange(6, dtype=torch.float32), "b/q": torch.arange(4, dtype=torch.uint8)}
    return wire.pack(tensors, {"run_id": "run-a", "kind": "update", "round": 3, **meta}, key=key)


def _rewrite_header(blob: bytes, edit) -> bytes:
    """Re-serialise the header after `edit(header_dict, meta_dict)`, keeping the data region as it is."""
    (hlen,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + hlen])
    meta = json.loads(header["__metadata__"]["ddiloco"])
    edit(header, meta)
    header["__metadata__"] = {"ddiloco": json.dumps(meta, sort_keys=True)}
    hbytes = json.dumps(header).encode()
    hbytes += b" " * (-len(hbytes) % 8)
    return struct.pack("<Q", len(hbytes)) + hbytes + blob[8 + hlen :]


def test_key_parsing_gives_one_line_errors():
    assert signing.parse_key("ab" * 16) == b"\xab" * 16
    with pytest.raises(ConfigError, match="not a hex string; generate one with `openssl rand -hex 32`"):
        signing.parse_key("not-hex")
    with pytest.raises(ConfigError, match="holds 4 bytes; use at least 16"):
        signing.parse_key("00112233")
    assert signing.key_from_env({}) is None
    assert signing.key_from_env({signing.ENV_VAR: "  "}) is None
    assert signing.key_from_env({signing.ENV_VAR: MASTER.hex()}) == MASTER


def test_key_file_is_private_created_once_and_reused(tmp_path):
    path = tmp_path / "runs" / "r1.key"
    first = signing.ensure_key_file(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert signing.ensure_key_file(path) == first
    assert len(signing.parse_key(first)) == 32
    assert signing.ensure_key_file(tmp_path / "r2.key") != first  # a fresh key per run


def test_every_run_signs_with_its_own_key():
    assert signing.for_run(None, "run-a") is None
    assert signing.for_run(MASTER, "run-a") == KEY
    assert signing.for_run(MASTER, "run-b") != KEY
    assert signing.for_run(b"\x01" * 32, "run-a") != KEY


def test_signed_payload_round_trips_and_a_reader_without_key_still_reads_it():
    blob = _payload()
    p = wire.unpack(blob, expect={"run_id": "run-a", "kind": "update"}, key=KEY)
    assert p.meta["key_id"] == signing.key_id(KEY.learner) and len(p.meta["mac"]) == 64
    assert torch.equal(p.tensors["w/data"], torch.arange(6, dtype=torch.float32))
    assert wire.unpack(blob).meta["round"] == 3


@pytest.mark.parametrize(
    "blob, reason, message",
    [
        (_payload(key=None), "unsigned", "no signature"),
        (_payload(key=signing.for_run(MASTER, "run-b")), "bad_signature", "another key"),
        (
            _rewrite_header(_payload(), lambda h, m: m.update(round=4)),  # a replay to another round
            "bad_signature",
            "altered after signing",
        ),
        (
            _rewrite_header(_payload(), lambda h, m: m.update(mac="0" * 64)),
            "bad_signature",
            "altered after signing",
        ),
        (
            _rewrite_header(_payload(), lambda h, m: m.update(mac=12)),
            "bad_signature",
            "altered after signing",
        ),
    ],
)
def test_a_key_holder_refuses_unsigned_and_wrongly_signed_payloads(blob, reason, message):
    with pytest.raises(wire.PayloadError, match=message) as e:
        wire.unpack(blob, expect=UPDATE, key=KEY)
    assert e.value.reason == reason


def test_tensor_table_is_covered_as_well_as_the_bytes():
    def swap(header, meta):  # same bytes, reinterpreted: only the tensor-table checksum can notice
        header["w/data"]["shape"] = [2, 3]

    with pytest.raises(wire.PayloadError) as e:
        wire.unpack(_rewrite_header(_payload(), swap), expect=UPDATE, key=KEY)
    assert e.value.reason == "checksum"


def test_whitespace_in_the_header_does_not_change_what_is_signed():
    blob = _payload()
    (hlen,) = struct.unpack("<Q", blob[:8])
    header = json.dumps(json.loads(blob[8 : 8 + hlen]), indent=1).encode()
    header += b" " * (-len(header) % 8)
    rewritten = struct.pack("<Q", len(header)) + header + blob[8 + hlen :]
    assert (
        wire.unpack(rewritten, expect=UPDATE, key=KEY).meta == wire.unpack(blob, expect=UPDATE, key=KEY).meta
    )


def test_foreign_run_is_reported_before_the_signature():
    other = signing.for_run(MASTER, "run-b")
    blob = wire.pack({"x": torch.zeros(2)}, {"run_id": "run-b", "kind": "update"}, key=other)
    with pytest.raises(wire.PayloadError) as e:
        wire.unpack(blob, expect={"run_id": "run-a"}, key=KEY)
    assert e.value.reason == "foreign_run"


def test_unsigned_mode_warns_once_per_role(caplog):
    signing._warned.discard("test-role")
    with caplog.at_level("WARNING"):
        signing.warn_unsigned("test-role")
        signing.warn_unsigned("test-role")
    assert sum("DDILOCO_RUN_KEY is not set" in r.message for r in caplog.records) == 1


# --- keys per role (issue 49): a learner's keys sign answers, only the syncer's sign what learners act on ---
LEARNER = signing.for_run(signing.key_from_env(signing.learner_env(MASTER)), "run-a")


def _global(key):
    return wire.pack({"w": torch.ones(3)}, {"run_id": "run-a", "kind": "global", "fragment_id": 0}, key=key)


def test_a_learner_holds_a_share_that_cannot_sign_as_the_syncer():
    env = signing.learner_env(MASTER)
    assert MASTER.hex() not in env.values() and set(env) == {"DDILOCO_LEARNER_KEY", "DDILOCO_SYNCER_PUBKEY"}
    assert LEARNER.seed is None and LEARNER.learner == KEY.learner and LEARNER.public == KEY.public
    with pytest.raises(ValueError, match="only the syncer's key can"):
        _global(LEARNER)
    assert wire.unpack(_global(KEY), expect={"kind": "global"}, key=LEARNER).meta["fragment_id"] == 0
    # the same answer signed by a learner verifies for the syncer
    assert wire.unpack(_payload(key=LEARNER), expect=UPDATE, key=KEY).meta["round"] == 3


def test_a_global_version_a_learner_signed_is_refused_by_every_reader():
    """A learner pod can compute an HMAC with its key over any header; relabelled as a global version (or
    read where no kind is named), it must not verify: only an Ed25519 signature of the syncer does."""
    forged = wire.pack(
        {"w": torch.ones(3)}, {"run_id": "run-a", "kind": "global", "fragment_id": 0}, key=None
    )
    forged = _rewrite_header(
        forged,
        lambda h, m: m.update(key_id=signing.key_id(KEY.learner), mac=signing._mac(KEY.learner, b"")),
    )
    for reader in (KEY, LEARNER):
        with pytest.raises(wire.PayloadError) as e:
            wire.unpack(forged, expect={"kind": "global"}, key=reader)
        assert e.value.reason == "bad_signature" and "learner's key" in str(e.value)
    with pytest.raises(wire.PayloadError, match="learner's key"):  # an update read where no kind is named
        wire.unpack(_payload(key=LEARNER), key=KEY)


def test_documents_are_signed_per_role_and_bound_to_the_run():
    status = {"run_id": "run-a", "done": True, "loss": float("nan")}
    signed = signing.sign_doc(status, KEY, signing.SYNCER)
    assert signing.check_doc(json.loads(json.dumps(signed)), LEARNER, signing.SYNCER) is None
    assert signing.check_doc(status, LEARNER, signing.SYNCER).startswith("unsigned")
    by_learner = signing.sign_doc(status, LEARNER, signing.LEARNER)
    assert signing.check_doc(by_learner, KEY, signing.LEARNER) is None
    assert signing.check_doc(by_learner, LEARNER, signing.SYNCER).startswith("bad_signature")
    altered = {**signed, "done": False}
    assert "altered" in signing.check_doc(altered, LEARNER, signing.SYNCER)
    other_run = signing.for_run(MASTER, "run-b")  # the syncer's key is one per master: the run id is bound
    assert signing.check_doc(signing.sign_doc(status, other_run, signing.SYNCER), LEARNER, signing.SYNCER)
    with pytest.raises(ValueError, match="only the syncer's key can"):
        signing.sign_doc(status, LEARNER, signing.SYNCER)


def test_a_learner_share_is_both_variables_or_a_one_line_error():
    env = signing.learner_env(MASTER)
    with pytest.raises(ConfigError, match="DDILOCO_SYNCER_PUBKEY is not set"):
        signing.key_from_env({"DDILOCO_LEARNER_KEY": env["DDILOCO_LEARNER_KEY"]})
    with pytest.raises(ConfigError, match="an Ed25519 key 32"):
        signing.key_from_env({**env, "DDILOCO_SYNCER_PUBKEY": "ab" * 20})
