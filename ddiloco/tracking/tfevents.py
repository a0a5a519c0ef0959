"""TensorBoard event files written by hand: TFRecord framing around `Event` protocol buffers of scalars.

Design choices:
- No `tensorboard` (nor protobuf, grpcio, ...) in the images that train: the only messages needed are
  `Event{wall_time, step, file_version | summary}` and `Summary.Value{tag, simple_value}`
  (tensorflow/core/util/event.proto, tensorflow/core/framework/summary.proto), a few fields encoded here.
  The tests read what this writes back with TensorBoard's own `event_accumulator` (the trusted reference).
- TFRecord framing: `uint64 length | uint32 masked_crc32c(length) | data | uint32 masked_crc32c(data)`,
  little endian, CRC-32C (Castagnoli) masked as `((c >> 15) | (c << 17)) + 0xa282ead8`.
- Values are float32 (`simple_value`): what TensorBoard's scalar dashboard plots. A step is an int64 ≥ 0.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping

FILE_VERSION = b"brain.Event:2"
_CRC_TABLE: list[int] = []
for _n in range(256):
    _c = _n
    for _ in range(8):
        _c = (_c >> 1) ^ 0x82F63B78 if _c & 1 else _c >> 1
    _CRC_TABLE.append(_c)


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli, reflected polynomial 0x82F63B78) of `data`."""
    crc, table = 0xFFFFFFFF, _CRC_TABLE
    for byte in data:
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def record(data: bytes) -> bytes:
    """One TFRecord holding `data`."""
    length = struct.pack("<Q", len(data))
    return length + struct.pack("<I", masked_crc32c(length)) + data + struct.pack("<I", masked_crc32c(data))


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        if n:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2)."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _event(wall_time: float, step: int, what: bytes) -> bytes:
    if step < 0:
        raise ValueError(f"a TensorBoard step is ≥ 0, got {step}")
    return b"\x09" + struct.pack("<d", wall_time) + b"\x10" + _varint(step) + what


def file_version_event(wall_time: float) -> bytes:
    """The record every event file starts with."""
    return record(_event(wall_time, 0, _field(3, FILE_VERSION)))


def scalars_event(values: Mapping[str, float], step: int, wall_time: float) -> bytes:
    """One record: an Event whose Summary holds one `simple_value` per tag."""
    summary = b"".join(
        _field(1, _field(1, tag.encode("utf-8")) + b"\x15" + struct.pack("<f", value))
        for tag, value in values.items()
    )
    return record(_event(wall_time, step, _field(5, summary)))
