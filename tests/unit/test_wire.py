import pytest
import torch

from ddiloco import keys
from ddiloco.protocol import wire


def _payload():
    tensors = {
        "a": torch.randn(3, 4),
        "b/q": torch.arange(10, dtype=torch.uint8),
        "c": torch.randn(5).to(torch.bfloat16),
    }
    return tensors, wire.pack(tensors, {"run_id": "r1", "kind": "update", "fragment_id": 2})


def test_round_trip_preserves_tensors_and_header():
    tensors, blob = _payload()
    p = wire.unpack(blob, expect={"run_id": "r1", "kind": "update"})
    assert p.meta["fragment_id"] == 2 and len(p.meta["sha256"]) == 64
    for k, t in tensors.items():
        assert torch.equal(p.tensors[k], t)


def test_payload_is_a_plain_safetensors_file():
    from safetensors.torch import load

    tensors, blob = _payload()
    assert set(load(blob)) == set(tensors)


@pytest.mark.parametrize(
    "mutate, reason",
    [
        (lambda b: b[:5], "truncated"),
        (lambda b: b[:-3], "truncated"),
        (lambda b: b[:-1] + bytes([b[-1] ^ 0xFF]), "checksum"),
        (lambda b: b"\x10\x00\x00\x00\x00\x00\x00\x00" + b"{not json}      ", "malformed"),
        (lambda b: b"garbage" * 10, "malformed"),
        (lambda b: b[: len(b) // 2], "truncated"),
    ],
)
def test_corruption_is_rejected_with_a_reason(mutate, reason):
    _, blob = _payload()
    with pytest.raises(wire.PayloadError) as e:
        wire.unpack(mutate(blob))
    assert e.value.reason == reason


def test_foreign_run_and_mismatch():
    _, blob = _payload()
    with pytest.raises(wire.PayloadError) as e:
        wire.unpack(blob, expect={"run_id": "other"})
    assert e.value.reason == "foreign_run"
    with pytest.raises(wire.PayloadError) as e:
        wire.unpack(blob, expect={"fragment_id": 3})
    assert e.value.reason == "mismatch"


def test_keys_are_sortable_and_valid_store_keys():
    assert keys.update_key(1, 42, 3, 0) == "updates/001/00000042/003-0000.safetensors"
    assert keys.global_key(0, 9) < keys.global_key(0, 10)
    assert keys.contributor(3, 1) == "3-1"
