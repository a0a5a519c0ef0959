"""An object's bytes as a sequence of buffers, so a big payload is written without joining it first.

Design choices:
- A payload the syncer publishes is a small header followed by tensors that already sit in memory (a
  fragment of the 1b preset is 193 MB). Joining them into one `bytes` costs a copy into fresh memory,
  which on Linux is paid in page faults (~0.1 s per fragment); a `Blob` names the buffers instead, and the
  backends that can write part by part (file) do so. Those that need one contiguous object (memory, S3's
  conditional PUT) join it once, as the caller would have.
- The parts are borrowed, not copied: the caller must not change them until the write returned.
- `take_into`/`read_into` read an object into memory the caller lends (a pooled buffer), the other half of
  publishing from reused memory.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterable

__all__ = ["Blob", "Data", "Lend", "as_bytes", "parts_of", "reader_of"]

Buffer = bytes | bytearray | memoryview
Lend = Callable[[int], memoryview]
"""Given a size in bytes, a writable byte buffer of at least that size (the caller's pooled memory)."""


def _byte_view(part: object) -> memoryview:
    m = memoryview(part)  # type: ignore[arg-type]
    if m.ndim != 1 or m.format != "B":
        m = m.cast("B")
    return m


class Blob:
    """The bytes of one object as buffers in order (module docstring)."""

    __slots__ = ("nbytes", "parts")

    def __init__(self, parts: Iterable[Buffer]) -> None:
        self.parts = tuple(_byte_view(p) for p in parts)
        self.nbytes = sum(len(p) for p in self.parts)

    def __len__(self) -> int:
        return self.nbytes

    def __bytes__(self) -> bytes:
        return b"".join(self.parts)

    def __repr__(self) -> str:
        return f"Blob({len(self.parts)} parts, {self.nbytes} bytes)"


Data = bytes | Blob
"""What a store write takes: bytes, or a `Blob` of borrowed buffers."""


def as_bytes(data: Data) -> bytes:
    """The object's bytes in one piece (no copy for bytes)."""
    return data if isinstance(data, bytes) else bytes(data)


def parts_of(data: Data) -> tuple[memoryview, ...] | tuple[bytes]:
    """The buffers to write in order."""
    return data.parts if isinstance(data, Blob) else (data,)


class _PartsReader(io.RawIOBase):
    def __init__(self, parts: tuple[memoryview, ...]) -> None:
        self._parts, self._i, self._off = parts, 0, 0

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:  # type: ignore[override]
        out = _byte_view(b)
        n = 0
        while n < len(out) and self._i < len(self._parts):
            part = self._parts[self._i]
            take = min(len(out) - n, len(part) - self._off)
            out[n : n + take] = part[self._off : self._off + take]
            n, self._off = n + take, self._off + take
            if self._off == len(part):
                self._i, self._off = self._i + 1, 0
        return n


def reader_of(data: Data) -> io.BufferedReader | io.BytesIO:
    """A fresh stream over the object's bytes (a stream per attempt: a retried upload reads from the start)."""
    if isinstance(data, bytes):
        return io.BytesIO(data)
    return io.BufferedReader(_PartsReader(data.parts), buffer_size=1 << 20)
