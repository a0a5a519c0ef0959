"""The header of a `.npy` token file, parsed from its first bytes, and range reads of its tokens.

Design choices:
- Only what a token file needs is accepted: a 1-D, C-order array of little-endian uint16 or uint32
  (`numpy.save(path, ids.astype(numpy.uint16))`). Anything else (2-D, floats, signed ints, big-endian,
  Fortran order, object arrays) is refused with one line naming the file and saying how to rewrite it,
  because a silently reinterpreted token stream trains on garbage.
- The header dict is parsed with `ast.literal_eval`: never pickle, never numpy's `allow_pickle`; the
  header length is capped (`MAX_HEADER_BYTES`) so a hostile object cannot make us read much.
- The object's size must equal the header's promise (data offset + count x itemsize): a truncated upload
  or a file with trailing bytes is an error at open, not a short read hours into training.
- `read_tokens` reads exactly a token range with one `Store.get_range` and returns a zero-copy,
  read-only numpy view of the bytes read (widened to int64 only by whoever builds a batch).
"""

from __future__ import annotations

import ast
import dataclasses
import struct
from typing import Any

import numpy as np

from ddiloco.errors import CorpusError
from ddiloco.store.base import Store

__all__ = ["CorpusError", "DTYPES", "HEADER_PROBE", "TokenFile", "parse_header", "read_header", "read_tokens"]

MAGIC = b"\x93NUMPY"
HEADER_PROBE = 4096
"""Bytes read to find a header: numpy writes headers of 128 bytes or less for 1-D arrays."""
MAX_HEADER_BYTES = 65536
DTYPES = {"<u2": "uint16", "<u4": "uint32"}
"""The `.npy` descr strings a token file may have, and their names."""
_HOW = "numpy.save(path, ids.astype(numpy.uint32))"


@dataclasses.dataclass(frozen=True)
class TokenFile:
    """One token file: its store key, dtype name (uint16/uint32), tokens, where they start, object size."""

    key: str
    dtype: str
    count: int
    data_offset: int
    size_bytes: int

    @property
    def itemsize(self) -> int:
        return np.dtype(self.dtype).itemsize

    @property
    def numpy_dtype(self) -> np.dtype:
        """Little-endian, whatever this machine's byte order."""
        return np.dtype(self.dtype).newbyteorder("<")

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> TokenFile:
        try:
            tf = cls(
                str(d["key"]), str(d["dtype"]), int(d["count"]), int(d["data_offset"]), int(d["size_bytes"])
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CorpusError(
                f"manifest entry {d!r} is not a token file record ({exc}); rebuild the manifest"
            ) from exc
        if tf.dtype not in DTYPES.values():
            raise CorpusError(f"manifest entry for {tf.key} has dtype {tf.dtype!r}; rebuild the manifest")
        return tf


def _header_span(key: str, head: bytes) -> tuple[int, int, str]:
    """(start of the header dict, its length, its text encoding) from the magic and version bytes."""
    if len(head) < 10 or not head.startswith(MAGIC):
        raise CorpusError(f"{key} is not a .npy file (no \\x93NUMPY magic); write token ids with {_HOW}")
    major, minor = head[6], head[7]
    if (major, minor) == (1, 0):
        return 10, struct.unpack("<H", head[8:10])[0], "latin1"
    if (major, minor) in ((2, 0), (3, 0)):
        if len(head) < 12:
            raise CorpusError(f"{key} is truncated inside its .npy header; rewrite it with {_HOW}")
        return 12, struct.unpack("<I", head[8:12])[0], "latin1" if major == 2 else "utf8"
    raise CorpusError(
        f"{key} has .npy format version {major}.{minor} (1.0, 2.0 or 3.0 expected); rewrite it with {_HOW}"
    )


def _dtype_error(key: str, descr: object) -> CorpusError:
    name = str(descr)
    try:
        dt = np.dtype(descr) if isinstance(descr, str) else None
    except (TypeError, ValueError):
        dt = None
    if dt is not None and dt.kind == "u" and dt.itemsize in (2, 4) and dt.byteorder == ">":
        return CorpusError(
            f"{key} holds big-endian {dt.name} tokens; write them little-endian "
            f"(numpy.save(path, ids.astype('<u{dt.itemsize}')))"
        )
    if dt is not None and not dt.fields:
        name = dt.name
    return CorpusError(f"{key} holds {name} tokens; write token ids as uint16 or uint32 ({_HOW})")


def parse_header(key: str, head: bytes, size_bytes: int) -> TokenFile:
    """The TokenFile of an object of `size_bytes` whose first bytes are `head` (at least the whole header);
    CorpusError if it is not a 1-D little-endian uint16/uint32 C-order array of exactly that size."""
    start, length, encoding = _header_span(key, head)
    if length > MAX_HEADER_BYTES:
        raise CorpusError(
            f"{key} has a {length}-byte .npy header (at most {MAX_HEADER_BYTES}); rewrite it with {_HOW}"
        )
    if len(head) < start + length:
        raise CorpusError(f"{key} is truncated inside its .npy header; rewrite it with {_HOW}")
    try:
        header = ast.literal_eval(head[start : start + length].decode(encoding))
    except (ValueError, SyntaxError, UnicodeDecodeError, MemoryError, RecursionError) as exc:
        raise CorpusError(f"{key} has an unreadable .npy header ({exc}); rewrite it with {_HOW}") from exc
    if not isinstance(header, dict) or set(header) != {"descr", "fortran_order", "shape"}:
        raise CorpusError(
            f"{key} has a .npy header without descr/fortran_order/shape; rewrite it with {_HOW}"
        )
    descr, fortran, shape = header["descr"], header["fortran_order"], header["shape"]
    if not isinstance(descr, str) or descr not in DTYPES:
        raise _dtype_error(key, descr)
    if fortran is not False:
        raise CorpusError(f"{key} is stored in Fortran order; write a C-order 1-D array ({_HOW})")
    if not isinstance(shape, tuple) or not all(isinstance(n, int) and n >= 0 for n in shape):
        raise CorpusError(f"{key} has a bad .npy shape {shape!r}; rewrite it with {_HOW}")
    if len(shape) != 1:
        raise CorpusError(
            f"{key} holds a {len(shape)}-D array of shape {shape}; token files must be 1-D: "
            f"save ids.reshape(-1) ({_HOW})"
        )
    dtype, count, data_offset = DTYPES[descr], shape[0], start + length
    expected = data_offset + count * np.dtype(dtype).itemsize
    if size_bytes != expected:
        what = "is truncated" if size_bytes < expected else "has trailing bytes"
        raise CorpusError(
            f"{key} {what}: its header promises {count} {dtype} tokens ({expected} bytes in all) but the "
            f"object has {size_bytes} bytes; rewrite or re-upload it"
        )
    return TokenFile(key, dtype, count, data_offset, size_bytes)


def read_header(store: Store, key: str, size_bytes: int) -> TokenFile:
    """Parse the header of the object at `key` (one range read; a second only for an unusually long one)."""
    head = store.get_range(key, 0, HEADER_PROBE)
    start, length, _ = _header_span(key, head)
    if len(head) < start + length <= min(size_bytes, start + MAX_HEADER_BYTES):
        head = store.get_range(key, 0, start + length)
    return parse_header(key, head, size_bytes)


def read_tokens(store: Store, tf: TokenFile, start: int, count: int) -> np.ndarray:
    """Tokens [start, start + count) of a file as a read-only little-endian uint16/uint32 array."""
    if start < 0 or count < 0 or start + count > tf.count:
        raise ValueError(f"token range [{start}, {start + count}) is outside {tf.key}'s {tf.count} tokens")
    data = store.get_range(tf.key, tf.data_offset + start * tf.itemsize, count * tf.itemsize)
    if len(data) != count * tf.itemsize:
        raise CorpusError(
            f"{tf.key} is shorter than when it was opened ({len(data)} of {count * tf.itemsize} bytes at token "
            f"{start}); was it rewritten during the run? Rebuild the manifest"
        )
    return np.frombuffer(data, dtype=tf.numpy_dtype)
