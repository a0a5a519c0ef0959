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


def test_unpacked_tensors_are_aligned_writable_copies_of_every_dtype_and_shape():
    # Odd-sized byte tensors put the next tensor's data at an offset no fp32/int64 value may start at;
    # each tensor is its own aligned, writable allocation, and writing it leaves the payload as it was.
    tensors = {
        "a/q": torch.arange(7, dtype=torch.uint8),
        "b": torch.randn(3, 5),
        "c": torch.arange(-3, 2, dtype=torch.int8),
        "d": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "e": torch.randn(4).to(torch.bfloat16),
        "f": torch.tensor(2.5),
        "g": torch.empty(0, 4),
        "h": torch.arange(3, dtype=torch.int32),
        "i": torch.randn(2).half(),
    }
    blob = wire.pack(tensors, {"run_id": "r1", "kind": "update"})
    before = bytes(blob)
    got = wire.unpack(blob).tensors
    for name, t in tensors.items():
        u = got[name]
        assert u.dtype == t.dtype and u.shape == t.shape and torch.equal(u, t), name
        assert u.data_ptr() % u.element_size() == 0 and u.is_contiguous(), name
        u.zero_()
    assert blob == before
    assert torch.equal(wire.unpack(blob).tensors["b"], tensors["b"])


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
