"""Property-based tests of the payload decoder: whatever bytes the store hands back, `wire.unpack` (and
the syncer's tensor checks after it) either return a payload or raise `PayloadError`, nothing else."""

import ast
import json
import struct
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ddiloco.protocol import signing, validation, wire

ROOT = Path(__file__).resolve().parents[2]
KEY = signing.for_run(b"\x07" * 32, "fuzz")
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
DTYPES = ["F32", "BF16", "F16", "U8", "I8", "I32", "I64", "F64", "BOOL", "", "x"]


def _valid() -> tuple[bytes, wire.Payload]:
    tensors = {
        "a/data": torch.linspace(-1, 1, 12),
        "b/q": torch.arange(16, dtype=torch.uint8),
        "b/scale": torch.tensor([0.5]),
        "c": torch.ones(2, 3, dtype=torch.bfloat16),
    }
    blob = wire.pack(tensors, {"run_id": "fuzz", "kind": "update", "c_steps": 3, "x": 1.5}, key=KEY)
    return blob, wire.unpack(blob, expect={"kind": "update"}, key=KEY)


VALID, DECODED = _valid()


def _decode_or_payload_error(blob: bytes, key: bytes | None = KEY) -> wire.Payload | None:
    try:
        return wire.unpack(blob, expect={"run_id": "fuzz", "kind": "update"}, key=key)
    except wire.PayloadError as e:
        assert e.reason in {
            "truncated", "malformed", "wrong_dtype", "checksum", "foreign_run", "unsigned", "bad_signature",
            "mismatch",
        }  # fmt: skip
        return None


def _same(p: wire.Payload) -> bool:
    return (
        p.meta == DECODED.meta
        and set(p.tensors) == set(DECODED.tensors)
        and all(torch.equal(p.tensors[k], DECODED.tensors[k]) for k in p.tensors)
    )


@FUZZ
@given(st.binary(max_size=4096))
def test_arbitrary_bytes(blob):
    _decode_or_payload_error(blob)
    _decode_or_payload_error(blob, key=None)


@FUZZ
@given(st.lists(st.tuples(st.integers(0, len(VALID) - 1), st.integers(0, 255)), min_size=1, max_size=8))
def test_mutated_signed_payload_never_verifies_as_something_else(edits):
    blob = bytearray(VALID)
    for pos, byte in edits:
        blob[pos] = byte
    p = _decode_or_payload_error(bytes(blob))
    # The only edits that may pass are those the canonical header absorbs (padding whitespace and the like).
    assert p is None or _same(p)


@FUZZ
@given(st.integers(0, len(VALID)), st.binary(max_size=64), st.booleans())
def test_truncated_and_spliced_payloads(cut, junk, append):
    _decode_or_payload_error(VALID[:cut] + (junk if append else b""))
    _decode_or_payload_error(junk + VALID[cut:])


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
entries = st.dictionaries(
    st.text(max_size=6),
    st.fixed_dictionaries(
        {
            "dtype": st.sampled_from(DTYPES),
            "shape": st.lists(st.integers(-2, 5), max_size=3) | json_values,
            "data_offsets": st.lists(st.integers(-4, 64), min_size=0, max_size=3) | json_values,
        }
    )
    | json_values,
    max_size=4,
)


@FUZZ
@given(entries, json_values, st.binary(max_size=80), st.booleans())
def test_crafted_headers(table, meta, data, good_checksums):
    """Headers shaped like ours, with hostile tables and metadata (checksums right, so the checks go deep)."""
    import hashlib

    table = dict(table)
    if good_checksums and isinstance(meta, dict):
        meta = {**meta, "format": wire.FORMAT_VERSION, "sha256": hashlib.sha256(data).hexdigest()}
        meta["tensors_sha256"] = hashlib.sha256(wire._canonical(table)).hexdigest()
    table["__metadata__"] = {"ddiloco": json.dumps(meta)}
    try:
        hbytes = json.dumps(table).encode()
    except ValueError:  # NaN/Inf floats are still JSON to Python, but keep this total
        return
    blob = struct.pack("<Q", len(hbytes)) + hbytes + data
    for key in (None, KEY):
        try:
            p = wire.unpack(blob, key=key)
        except wire.PayloadError:
            continue
        for name, t in p.tensors.items():  # whatever passes is exactly what the table says
            assert list(t.shape) == table[name]["shape"]


parts = st.dictionaries(
    st.sampled_from(["w/data", "w/q", "w/scale", "v/data", "v/q", "v/scale", "x", "w/y"]),
    st.tuples(
        st.sampled_from([torch.float32, torch.bfloat16, torch.uint8, torch.int8, torch.float16]),
        st.integers(0, 300),
        st.sampled_from([0.0, 1.0, -1.0, 1e38, float("nan"), float("inf")]),
    ),
    max_size=5,
)


@FUZZ
@given(parts, st.sampled_from(["fp32", "bf16", "int8", "int4", "int2", "int3"]))
def test_delta_decoding_after_unpack(spec, codec):
    """The syncer's tensor checks: only PayloadError, and what passes is finite and of the layout's shape."""
    shapes = {"w": [3, 50], "v": [7]}
    tensors = {}
    for k, (dtype, n, fill) in spec.items():
        t = torch.full((n,), fill) if dtype.is_floating_point else torch.randint(0, 255, (n,))
        tensors[k] = t.to(dtype)
    try:
        delta = validation.decode_delta(tensors, codec, ["w", "v"], shapes)
    except wire.PayloadError:
        return
    assert {n: list(t.shape) for n, t in delta.items()} == shapes
    assert all(bool(torch.isfinite(t).all()) for t in delta.values())


def test_real_codec_parts_decode():
    from ddiloco.codec.registry import encode

    shapes = {"w": [3, 50], "v": [7]}
    for codec in ("fp32", "bf16", "int8", "int4", "int2"):
        tensors = {
            f"{n}/{part}": t
            for n, shape in shapes.items()
            for part, t in encode(torch.randn(shape), codec).items()
        }
        delta = validation.decode_delta(tensors, codec, ["w", "v"], shapes)
        assert {n: list(t.shape) for n, t in delta.items()} == shapes


# --- safe loading: nothing that reads the store can execute code ------------------------------------------
LIBRARY = sorted((ROOT / "ddiloco").rglob("*.py"))
UNSAFE_CALLS = {
    "torch.load",
    "pickle.load",
    "pickle.loads",
    "np.load",
    "numpy.load",
    "yaml.load",
    "yaml.unsafe_load",
    "eval",
    "exec",
}
UNSAFE_MODULES = {"pickle", "dill", "marshal", "shelve", "joblib", "cloudpickle"}


def test_no_unsafe_deserialisation_anywhere_in_the_library():
    """safetensors + JSON only: no torch.load, pickle & co., unsafe YAML or eval of anything read."""
    offenders = []
    for path in LIBRARY:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func) in UNSAFE_CALLS:
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)[:80]}")
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            if any(n.split(".")[0] in UNSAFE_MODULES for n in names):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: imports {names}")
    assert not offenders, offenders


def _unbounded_gets(path: Path) -> list[str]:
    """Calls `<store>.get(...)` / `.get_or_none(...)` without `max_bytes` (JSON reads have a default cap)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("get", "get_or_none")
            and "store" in ast.unparse(node.func.value).lower()
            and not any(k.arg == "max_bytes" for k in node.keywords)
        ):
            out.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    return out


@pytest.mark.parametrize(
    "path",
    [pytest.param(p, id=str(p.relative_to(ROOT))) for p in LIBRARY if "store" not in p.parts],
)
def test_every_store_read_has_a_size_limit(path):
    assert not _unbounded_gets(path)
