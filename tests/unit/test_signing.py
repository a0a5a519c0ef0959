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
    p = wire.unpack(blob, expect={"run_id": "run-a"}, key=KEY)
    assert p.meta["key_id"] == signing.key_id(KEY) and len(p.meta["mac"]) == 64
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
        wire.unpack(blob, key=KEY)
    assert e.value.reason == reason


def test_tensor_table_is_covered_as_well_as_the_bytes():
    def swap(header, meta):  # same bytes, reinterpreted: only the tensor-table checksum can notice
        header["w/data"]["shape"] = [2, 3]

    with pytest.raises(wire.PayloadError) as e:
        wire.unpack(_rewrite_header(_payload(), swap), key=KEY)
    assert e.value.reason == "checksum"


def test_whitespace_in_the_header_does_not_change_what_is_signed():
    blob = _payload()
    (hlen,) = struct.unpack("<Q", blob[:8])
    header = json.dumps(json.loads(blob[8 : 8 + hlen]), indent=1).encode()
    header += b" " * (-len(header) % 8)
    rewritten = struct.pack("<Q", len(header)) + header + blob[8 + hlen :]
    assert wire.unpack(rewritten, key=KEY).meta == wire.unpack(blob, key=KEY).meta


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
