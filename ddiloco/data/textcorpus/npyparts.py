"""Token ids -> `.npy` parts of at most `shard_tokens` tokens, from one bounded buffer.

Design choices:
- A part is what `numpy.save` writes (format version 1.0 header) of a 1-D little-endian array: uint16 when
  the vocabulary fits (vocab_size <= 65536), else uint32; a vocabulary beyond uint32 is refused.
- Parts are cut at exactly `shard_tokens` tokens (the last one of a file shorter), wherever documents end,
  so the parts of a file depend only on its token stream, not on how documents were batched: a rerun
  writes the same bytes under the same keys. A reader concatenates parts in key order.
- One buffer of `shard_tokens` ids per writer (allocated once, filled in place), written as a header plus
  the buffer's own memory (`Blob`: no joined copy). With the batch being encoded that is the writer's
  whole memory, whatever the size of the input.
- Keys: `part-{unit:06d}-{index:05d}.npy` under the corpus prefix; unit is the input file's position in
  the sorted file list, so the key order is the corpus order.
"""

from __future__ import annotations

import io

import numpy as np

from ddiloco.errors import CorpusError
from ddiloco.store.base import Store
from ddiloco.store.blob import Blob

UINT16_VOCAB = 1 << 16
UINT32_VOCAB = 1 << 32


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 for a vocabulary of at most 65536 ids, uint32 up to 2**32, little-endian either way."""
    if vocab_size < 1:
        raise CorpusError(f"tokenizer vocab_size must be positive, got {vocab_size}")
    if vocab_size <= UINT16_VOCAB:
        return np.dtype("<u2")
    if vocab_size <= UINT32_VOCAB:
        return np.dtype("<u4")
    raise CorpusError(
        f"tokenizer vocab_size {vocab_size} exceeds uint32 ({UINT32_VOCAB} ids); use a smaller vocabulary"
    )


def npy_header(dtype: np.dtype, n: int) -> bytes:
    """The `.npy` version 1.0 header of a 1-D array of n items of dtype."""
    out = io.BytesIO()
    np.lib.format.write_array_header_1_0(out, {"descr": dtype.str, "fortran_order": False, "shape": (n,)})
    return out.getvalue()


def part_key(unit: int, index: int) -> str:
    return f"part-{unit:06d}-{index:05d}.npy"


class PartWriter:
    """Appends token ids of one unit (input file) and writes a part each time `shard_tokens` are buffered."""

    def __init__(self, store: Store, prefix: str, unit: int, dtype: np.dtype, shard_tokens: int) -> None:
        if shard_tokens < 1:
            raise CorpusError(f"shard_tokens must be positive, got {shard_tokens}")
        self.store, self.prefix, self.unit, self.dtype = store, prefix, unit, dtype
        self.shard_tokens = shard_tokens
        self._buf = np.empty(shard_tokens, dtype=dtype)  # pages are touched only as they fill
        self._fill = 0
        self.parts: list[dict[str, int | str]] = []
        self.tokens = 0

    def add(self, ids: np.ndarray) -> None:
        """Append ids (any integer dtype whose values fit)."""
        done = 0
        while done < ids.size:
            take = min(ids.size - done, self.shard_tokens - self._fill)
            self._buf[self._fill : self._fill + take] = ids[done : done + take]
            self._fill += take
            done += take
            if self._fill == self.shard_tokens:
                self._flush()
        self.tokens += int(ids.size)

    def close(self) -> list[dict[str, int | str]]:
        """Write the last, partial part; the parts written, in order ({"key", "tokens"})."""
        if self._fill:
            self._flush()
        return self.parts

    def _flush(self) -> None:
        key = part_key(self.unit, len(self.parts))
        data = self._buf[: self._fill]
        self.store.put(
            f"{self.prefix}/{key}", Blob([npy_header(self.dtype, self._fill), data.view(np.uint8)])
        )
        self.parts.append({"key": key, "tokens": self._fill})
        self._fill = 0
