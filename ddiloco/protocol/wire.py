"""Object-store keys and the payload format: the only place that knows key names and byte layouts.

One run is one prefix; every key is relative to the run root. Payloads are safetensors files (no pickle:
nothing read from the store can execute code), written here so the JSON header (`__metadata__["ddiloco"]`)
can carry the SHA-256 of the data region and of the tensor table and, with a key, a signature over that
header (`ddiloco.protocol.signing`), which authenticates header, layout and bytes at once. `unpack` trusts
nothing: it checks the header, the table, both checksums, the run id and the signature before safetensors
parses, and every problem is a `PayloadError(reason)` (a property-based test fuzzes this). The format is 2;
format-1 objects are `malformed`. `RunSigner` is one run on the wire, so no caller passes keys or run ids.

Design notes: docs/internals.md, "The payload format".
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from safetensors.torch import load as st_load

from ddiloco.protocol import signing
from ddiloco.store.blob import Blob

FORMAT_VERSION = 2

# --- keys ----------------------------------------------------------------------------------------------------
# --- payloads ------------------------------------------------------------------------------------------------
_DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.int32: "I32",
    torch.int64: "I64",
}
_ITEMSIZE = {"F32": 4, "BF16": 2, "F16": 2, "U8": 1, "I8": 1, "I32": 4, "I64": 8}
_BY_NAME = {name: dtype for dtype, name in _DTYPES.items()}
MAX_HEADER_BYTES = 16 << 20


class PayloadError(ValueError):
    """A payload failed validation; `reason` is a short machine-readable tag (for metrics and the summary).

    Reasons raised here: truncated, malformed, wrong_dtype, checksum, foreign_run, unsigned, bad_signature,
    mismatch. The syncer adds its own (see `ddiloco.syncer.loop`)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason


@dataclass(slots=True)
class Payload:
    meta: dict[str, Any]
    tensors: dict[str, torch.Tensor]


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def _raw(t: torch.Tensor) -> memoryview:
    """The tensor's bytes without a copy (a CPU tensor's own memory, a contiguous copy otherwise): what
    hashing and `pack`'s single join read. A fragment of the 1b preset is 193 MB, and every copy of it into
    fresh memory costs ~0.1 s of page faults."""
    return memoryview(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy())


def data_sha256(tensors: Mapping[str, torch.Tensor]) -> str:
    """The SHA-256 `pack` puts in the header for these tensors: of their bytes, in sorted name order."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(_raw(tensors[name]))
    return h.hexdigest()


def pack(tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any], **options: Any) -> bytes:
    """`pack_blob` (same options: `key`, `data_sha256`) joined into one bytes object (the one copy of the
    data)."""
    return bytes(pack_blob(tensors, meta, **options))


def pack_blob(
    tensors: Mapping[str, torch.Tensor],
    meta: Mapping[str, Any],
    *,
    key: signing.RunKeys | None = None,
    data_sha256: str | None = None,
) -> Blob:
    """Serialise tensors + JSON header as a safetensors file, as a `Blob` whose data parts are the tensors'
    own memory (written by the store without a copy; the tensors must not change until it is written). The header carries the SHA-256 of the data
    region and of the tensor table, and, with a run `key`, an HMAC over all of it (see `ddiloco.protocol.signing`).

    `data_sha256`: the writer's own `data_sha256(tensors)`, computed already (the syncer names a version's
    digest in its download delta before it packs the version): the data is then not hashed again. A wrong
    one makes a payload every reader refuses (`checksum`), never one that verifies."""
    entries: dict[str, Any] = {}
    chunks: list[memoryview] = []
    offset = 0
    for name in sorted(tensors):
        t = tensors[name].detach()
        if t.dtype not in _DTYPES:
            raise TypeError(f"tensor {name!r} has unsupported dtype {t.dtype}")
        raw = _raw(t)
        entries[name] = {
            "dtype": _DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + len(raw)],
        }
        chunks.append(raw)
        offset += len(raw)
    if data_sha256 is None:
        data_hash = hashlib.sha256()
        for raw in chunks:
            data_hash.update(raw)
        data_sha256 = data_hash.hexdigest()
    signed = (signing.MAC_FIELD, signing.SIG_FIELD, signing.KEY_ID_FIELD)
    full_meta = {k: v for k, v in meta.items() if k not in signed}
    full_meta["format"] = FORMAT_VERSION
    full_meta["sha256"] = data_sha256
    full_meta["tensors_sha256"] = hashlib.sha256(_canonical(entries)).hexdigest()
    if key is not None:
        signing.sign_payload(full_meta, key)
    header = dict(entries)
    header["__metadata__"] = {"ddiloco": json.dumps(full_meta, sort_keys=True)}
    hbytes = json.dumps(header, separators=(",", ":")).encode()
    hbytes += b" " * (-len(hbytes) % 8)  # safetensors aligns the data region to 8 bytes
    return Blob([struct.pack("<Q", len(hbytes)), hbytes, *chunks])


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # Two parsers read the header (json here, serde in safetensors); a duplicate key is where they could
    # disagree about what was authenticated, so it is refused outright.
    d = dict(pairs)
    if len(d) != len(pairs):
        raise ValueError("duplicate key in JSON object")
    return d


def _json(raw: bytes | str) -> Any:
    try:
        return json.loads(raw, object_pairs_hook=_no_duplicates)
    except (ValueError, TypeError, RecursionError) as e:
        raise PayloadError(
            "malformed", f"header is not valid JSON ({type(e).__name__}: {str(e)[:80]})"
        ) from None


def _is_count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _check_entries(entries: dict[str, Any], data_len: int) -> None:
    """The tensor table must tile the data region exactly: known dtypes, sizes that match shapes."""
    spans = []
    for name, e in entries.items():
        if not isinstance(e, dict) or set(e) != {"dtype", "shape", "data_offsets"}:
            raise PayloadError("malformed", f"tensor entry {name[:60]!r} is not a safetensors entry")
        dtype, shape, offs = e["dtype"], e["shape"], e["data_offsets"]
        if dtype not in _ITEMSIZE:
            raise PayloadError("wrong_dtype", f"tensor {name[:60]!r} has dtype {str(dtype)[:20]!r}")
        if not (isinstance(shape, list) and all(_is_count(d) for d in shape)):
            raise PayloadError("malformed", f"tensor {name[:60]!r} has a bad shape")
        if not (isinstance(offs, list) and len(offs) == 2 and all(_is_count(o) for o in offs)):
            raise PayloadError("malformed", f"tensor {name[:60]!r} has bad data offsets")
        if offs[1] - offs[0] != math.prod(shape) * _ITEMSIZE[dtype]:
            raise PayloadError("malformed", f"tensor {name[:60]!r}: offsets do not match its shape")
        spans.append((offs[0], offs[1]))
    end = 0
    for begin, stop in sorted(spans):
        if begin != end:
            raise PayloadError("malformed", "tensor data regions overlap or leave gaps")
        end = stop
    if end > data_len:
        raise PayloadError("truncated", f"data region is {data_len} bytes, the header describes {end}")
    if end < data_len:
        raise PayloadError("malformed", f"{data_len - end} bytes after the last tensor")


def unpack(
    blob: bytes | memoryview,
    *,
    expect: Mapping[str, Any] | None = None,
    key: signing.RunKeys | None = None,
    borrow: bool = False,
) -> Payload:
    """Parse and verify a payload; raises only `PayloadError(reason)` for bad input.

    `borrow`: `blob` is a writable buffer the caller lends (pooled memory it keeps until it is done with the
    tensors): the tensors are views of it, built from the tensor table `_check_entries` validated, instead
    of copies made by safetensors' parser (a 193 MB fragment read back by the syncer is not copied again).

    `expect` maps header fields to required values (run_id, kind, fragment_id, ...). With a run `key` a valid
    signature is required (`unsigned` / `bad_signature`); without one a signature is not checked. Order:
    structure (truncated, malformed, wrong_dtype) → integrity (checksum) → run id (foreign_run: an object
    from another run is reported as such, even though it cannot verify under this run's key) → signature →
    the other expected fields (mismatch) → the safetensors parse, cross-checked against the tensor table.
    """
    if len(blob) < 8:
        raise PayloadError("truncated", f"payload is {len(blob)} bytes, shorter than a safetensors header")
    (hlen,) = struct.unpack("<Q", blob[:8])
    if hlen > MAX_HEADER_BYTES or (hlen > len(blob) - 8 and blob[8:9] != b"{"):
        raise PayloadError("malformed", f"not a safetensors payload (header length {hlen})")
    if hlen > len(blob) - 8:
        raise PayloadError("truncated", f"header length {hlen} exceeds the object size {len(blob)}")
    header = _json(bytes(blob[8 : 8 + hlen]))
    if not isinstance(header, dict):
        raise PayloadError("malformed", "header is not a JSON object")
    md = header.pop("__metadata__", None)
    if not (isinstance(md, dict) and set(md) == {"ddiloco"} and isinstance(md["ddiloco"], str)):
        raise PayloadError("malformed", "header is not a ddiloco safetensors header")
    meta = _json(md["ddiloco"])
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION:
        fmt = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise PayloadError("malformed", f"unsupported payload format {str(fmt)[:40]!r}")
    data = memoryview(blob)[8 + hlen :]
    _check_entries(header, len(data))
    if hashlib.sha256(data).hexdigest() != meta.get("sha256"):
        raise PayloadError("checksum", "SHA-256 of the data region does not match the header")
    if hashlib.sha256(_canonical(header)).hexdigest() != meta.get("tensors_sha256"):
        raise PayloadError("checksum", "SHA-256 of the tensor table does not match the header")
    expect = dict(expect or {})
    if "run_id" in expect and meta.get("run_id") != expect["run_id"]:
        raise PayloadError(
            "foreign_run", f"payload of run {str(meta.get('run_id'))[:80]!r}, expected {expect['run_id']!r}"
        )
    if key is not None:
        problem = signing.check_payload(meta, key, signing.role_of(expect.get("kind")))
        if problem is not None:
            reason, why = problem.split(": ", 1)
            raise PayloadError(reason, why)
    for field, want in expect.items():
        if meta.get(field) != want:
            raise PayloadError(
                "mismatch", f"header field {field}={str(meta.get(field))[:80]!r}, expected {want!r}"
            )
    if borrow:
        return Payload(meta=meta, tensors=_views(header, data))
    try:
        tensors = st_load(bytes(blob))
    except Exception as e:  # safetensors raises its own error type for every structural problem
        raise PayloadError("malformed", f"safetensors rejected the payload ({e})") from None
    except BaseException as e:  # a panic in the Rust parser surfaces as pyo3's PanicException
        if type(e).__name__ != "PanicException":
            raise
        raise PayloadError("malformed", "safetensors could not parse the payload") from None
    if set(tensors) != set(header) or any(
        _BY_NAME[header[n]["dtype"]] != t.dtype or list(t.shape) != header[n]["shape"]
        for n, t in tensors.items()
    ):
        raise PayloadError("malformed", "safetensors read a different tensor table than the header shows")
    return Payload(meta=meta, tensors=tensors)


def _views(entries: dict[str, Any], data: memoryview) -> dict[str, torch.Tensor]:
    """The tensors of a validated table as views of `data` (a copy only where a tensor's bytes are not
    aligned to its dtype)."""
    out = {}
    for name, e in entries.items():
        begin, end = e["data_offsets"]
        dtype = _BY_NAME[e["dtype"]]
        if end == begin:
            out[name] = torch.empty(e["shape"], dtype=dtype)
            continue
        raw = torch.frombuffer(data[begin:end], dtype=torch.uint8)
        if raw.data_ptr() % _ITEMSIZE[e["dtype"]]:
            raw = raw.clone()
        out[name] = raw.view(dtype).view(e["shape"])
    return out


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


@dataclass(frozen=True, slots=True)
class RunSigner:
    """One run's payloads: every payload packed names `run_id` and, with a `key`, is signed with it; every
    payload unpacked must name `run_id` and, with a key, verify under it. `key=None`: an unsigned run (nothing
    signed, no signature required). Obtained from `ddiloco.run.root.RunRoot.signer`."""

    run_id: str
    key: signing.RunKeys | None = dataclasses.field(default=None, repr=False)

    def pack(
        self, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any], *, data_sha256: str | None = None
    ) -> bytes:
        """`pack` with this run's id in the header, signed with its key."""
        return bytes(self.pack_blob(tensors, meta, data_sha256=data_sha256))

    def pack_blob(
        self, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any], *, data_sha256: str | None = None
    ) -> Blob:
        """`pack_blob` with this run's id in the header, signed with its key."""
        return pack_blob(tensors, {**meta, "run_id": self.run_id}, key=self.key, data_sha256=data_sha256)

    def unpack(
        self, blob: bytes | memoryview, expect: Mapping[str, Any] | None = None, *, borrow: bool = False
    ) -> Payload:
        """`unpack` requiring this run's id besides `expect`, and with a key a valid signature."""
        return unpack(blob, expect={**(expect or {}), "run_id": self.run_id}, key=self.key, borrow=borrow)
