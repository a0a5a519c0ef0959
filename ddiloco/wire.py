"""Object-store keys and the payload format: the only place that knows key names and byte layouts.

Design choices:
- One run = one prefix; every key below is relative to the run root.
- Payloads are safetensors files (no pickle: nothing read from the store can execute code). We write the
  format ourselves so the header can carry a SHA-256 of the data region in one pass, and read it back with
  the `safetensors` library, which validates offsets and dtypes.
- The JSON header (`__metadata__["ddiloco"]`) carries run_id, kind, fragment, versions, counters, codec and
  the tensor list; `unpack` checks size, structure and checksum and raises `PayloadError(reason)` so the
  syncer can count rejections by reason.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from safetensors.torch import load as st_load

FORMAT_VERSION = 1

# --- keys ----------------------------------------------------------------------------------------------------
CONFIG = "config.json"
DATA_META = "data/meta.json"
TOKENIZER = "data/tokenizer.json"
VAL = "data/val.safetensors"
LAYOUT = "global/layout.json"
STATUS = "syncer/status.json"
SYNCER_STATE = "syncer/state.json"
FINAL_MODEL = "final/model.safetensors"
FINAL_META = "final/meta.json"
DONE = "done.json"
SUMMARY = "summary.json"
LAUNCHER_EVENTS = "launcher/events.json"


def shard_key(i: int) -> str:
    return f"data/shard-{i:04d}.safetensors"


def global_key(p: int, version: int) -> str:
    return f"global/{p:03d}/v{version:08d}.safetensors"


def global_latest_key(p: int) -> str:
    return f"global/{p:03d}/latest.json"


def momentum_key(p: int, version: int) -> str:
    return f"syncer/momentum/{p:03d}/v{version:08d}.safetensors"


def round_record_key(round_: int) -> str:
    return f"syncer/rounds/{round_:08d}.json"


def update_prefix(p: int, round_: int) -> str:
    return f"updates/{p:03d}/{round_:08d}/"


def update_key(p: int, round_: int, learner_id: int, incarnation: int) -> str:
    return f"{update_prefix(p, round_)}{learner_id:03d}-{incarnation:04d}.safetensors"


def learner_prefix(learner_id: int) -> str:
    return f"learners/{learner_id:03d}/"


def incarnation_key(learner_id: int) -> str:
    return f"{learner_prefix(learner_id)}incarnation.json"


def report_key(learner_id: int, incarnation: int) -> str:
    return f"{learner_prefix(learner_id)}inc-{incarnation:04d}/report.json"


def ckpt_key(learner_id: int, step: int) -> str:
    return f"{learner_prefix(learner_id)}ckpt/step-{step:08d}.safetensors"


def ckpt_latest_key(learner_id: int) -> str:
    return f"{learner_prefix(learner_id)}ckpt/latest.json"


def contributor(learner_id: int, incarnation: int) -> str:
    """The name a learner incarnation goes by in round records and the status object."""
    return f"{learner_id}-{incarnation}"


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


class PayloadError(ValueError):
    """A payload failed validation; `reason` is a short machine-readable tag (for metrics and the summary)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason


@dataclass(slots=True)
class Payload:
    meta: dict[str, Any]
    tensors: dict[str, torch.Tensor]


def pack(tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> bytes:
    """Serialise tensors + JSON header as a safetensors file whose header holds a SHA-256 of the data."""
    entries: dict[str, Any] = {}
    chunks: list[bytes] = []
    offset = 0
    for name in sorted(tensors):
        t = tensors[name].detach()
        if t.dtype not in _DTYPES:
            raise TypeError(f"tensor {name!r} has unsupported dtype {t.dtype}")
        raw = t.contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
        entries[name] = {
            "dtype": _DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + len(raw)],
        }
        chunks.append(raw)
        offset += len(raw)
    data = b"".join(chunks)
    full_meta = dict(meta)
    full_meta["format"] = FORMAT_VERSION
    full_meta["sha256"] = hashlib.sha256(data).hexdigest()
    header = dict(entries)
    header["__metadata__"] = {"ddiloco": json.dumps(full_meta, sort_keys=True)}
    hbytes = json.dumps(header, separators=(",", ":")).encode()
    hbytes += b" " * (-len(hbytes) % 8)  # safetensors aligns the data region to 8 bytes
    return struct.pack("<Q", len(hbytes)) + hbytes + data


def unpack(blob: bytes, *, expect: Mapping[str, Any] | None = None) -> Payload:
    """Parse and verify a payload. `expect` maps header fields to required values (e.g. run_id, kind)."""
    if len(blob) < 8:
        raise PayloadError("truncated", f"payload is {len(blob)} bytes, shorter than a safetensors header")
    (hlen,) = struct.unpack("<Q", blob[:8])
    if hlen > len(blob) - 8 or hlen > 16 << 20:
        raise PayloadError("truncated", f"header length {hlen} exceeds the object size {len(blob)}")
    try:
        header = json.loads(blob[8 : 8 + hlen])
        meta = json.loads(header["__metadata__"]["ddiloco"])
    except (ValueError, KeyError, TypeError) as e:
        raise PayloadError("malformed", f"header is not a ddiloco safetensors header ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION:
        raise PayloadError(
            "malformed",
            f"unsupported payload format {meta.get('format') if isinstance(meta, dict) else meta!r}",
        )
    data = memoryview(blob)[8 + hlen :]
    if hashlib.sha256(data).hexdigest() != meta.get("sha256"):
        raise PayloadError("checksum", "SHA-256 of the data region does not match the header")
    for key, want in (expect or {}).items():
        if meta.get(key) != want:
            reason = "foreign_run" if key == "run_id" else "mismatch"
            raise PayloadError(reason, f"header field {key}={meta.get(key)!r}, expected {want!r}")
    try:
        tensors = st_load(bytes(blob))
    except Exception as e:  # safetensors raises its own error type for every structural problem
        raise PayloadError("malformed", f"safetensors rejected the payload ({e})") from None
    return Payload(meta=meta, tensors=tensors)


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
