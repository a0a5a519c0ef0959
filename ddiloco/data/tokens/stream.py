"""Resumable (x, y) batches streamed from a learner's token chunks, with a bounded read-ahead thread.

The interface is `ddiloco.data.loader.ShardLoader`'s, so a learner can use either; here the shard is a list of
chunks (`ddiloco.data.tokens.ranges`) read with `Store.get_range`, never the whole shard. The order is fixed by
the seed (chunks per epoch, windows per chunk), and the cursor (epoch, chunk, window, plus a fingerprint of
the assignment) lets `load_state_dict` continue at exactly the next unread window. A daemon thread
(`ddiloco.data.tokens.readahead`) fetches chunks ahead under permits, so at most read_ahead + 1 chunks are in
memory whatever the corpus size. A failed fetch is raised by the `next_batch` that needed it and leaves the
cursor where that batch began, so a retry gives the same batch.

Design notes: docs/internals.md, "Pre-tokenized corpora".
"""

from __future__ import annotations

import hashlib
import json
import logging
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ddiloco.data.tokens.corpus import TokenCorpus, files_of
from ddiloco.data.tokens.npy import TokenFile, read_tokens
from ddiloco.data.tokens.readahead import ReadAhead, memo
from ddiloco.store.base import Store

logger = logging.getLogger(__name__)

__all__ = ["StreamLoader", "assignment_fingerprint"]

CURSOR_FORMAT = "ddiloco.data.tokens.cursor/1"


def assignment_fingerprint(files: Sequence[TokenFile], chunks: Sequence[Sequence[int]]) -> str:
    """A short hash of the files (key, dtype, count) and the chunks a loader reads."""
    doc = [[[f.key, f.dtype, f.count] for f in files], [list(map(int, c)) for c in chunks]]
    return hashlib.sha256(json.dumps(doc).encode()).hexdigest()[:16]


def _rng(*words: int) -> np.random.Generator:
    return np.random.default_rng([w % 2**64 for w in words])  # SeedSequence wants ints >= 0


class StreamLoader:
    """Deterministic, resumable (x, y) int64 batches of shape (batch_size, seq_len) from token chunks."""

    def __init__(
        self,
        store: Store,
        corpus_or_manifest: TokenCorpus | dict[str, Any],
        chunks: Sequence[Sequence[int]],
        *,
        batch_size: int,
        seq_len: int,
        seed: int,
        read_ahead: int = 2,
    ) -> None:
        if batch_size < 1 or seq_len < 1 or read_ahead < 0:
            raise ValueError(
                f"batch_size and seq_len must be positive and read_ahead >= 0, got {batch_size}, {seq_len}, {read_ahead}"
            )
        self.store, self.files = store, files_of(corpus_or_manifest)
        self.batch_size, self.seq_len, self.seed, self.read_ahead = batch_size, seq_len, seed, read_ahead
        self.fingerprint = assignment_fingerprint(self.files, chunks)
        for f, start, count in chunks:
            if not (
                0 <= f < len(self.files) and 0 <= start and 0 < count and start + count <= self.files[f].count
            ):
                raise ValueError(f"chunk {[f, start, count]} is not a token range of the corpus's files")
        # chunks without a window of seq_len + 1 tokens are skipped
        self.chunks = [tuple(map(int, c)) for c in chunks if (c[2] - 1) // seq_len > 0]
        if not self.chunks:
            raise ValueError(
                f"none of the {len(chunks)} chunks holds a window of seq_len + 1 = {seq_len + 1} tokens; use larger "
                f"chunks or a shorter seq_len"
            )
        self._windows = np.array([(c[2] - 1) // seq_len for c in self.chunks], dtype=np.int64)
        self.total_windows = int(self._windows.sum())
        self.epoch = self.chunk = self.window = 0
        self._order_cache: tuple[int, np.ndarray, np.ndarray] | None = None
        self._fetcher: ReadAhead | None = None
        self._current: tuple[np.ndarray, np.ndarray] | None = None  # (tokens, window order) of chunk in use
        self._arange = np.arange(seq_len + 1)

    # ---- order ----

    def _order(self) -> tuple[np.ndarray, np.ndarray]:
        """This epoch's chunk order and the windows read before each position (consumer thread only)."""
        if self._order_cache is None or self._order_cache[0] != self.epoch:
            order = _rng(self.seed, self.epoch).permutation(len(self.chunks))
            before = np.concatenate([[0], np.cumsum(self._windows[order])[:-1]])
            self._order_cache = (self.epoch, order, before)
        return self._order_cache[1], self._order_cache[2]

    # ---- reading ----

    def _take_chunk(self) -> tuple[np.ndarray, np.ndarray]:
        if self._current is None:
            if self._fetcher is None:
                self._fetcher = self._start_fetcher()
            try:
                epoch, pos, tokens = self._fetcher.take()
            except BaseException:
                self._stop_fetcher()
                raise
            if (epoch, pos) != (self.epoch, self.chunk):
                raise RuntimeError(
                    f"read-ahead at {(epoch, pos)} out of step with the cursor {self.state_dict()}"
                )
            i = int(self._order()[0][pos])
            self._current = (tokens, _rng(self.seed, self.epoch, i).permutation(int(self._windows[i])))
        return self._current

    def _finish_chunk(self) -> None:
        self._current = None
        if self._fetcher is not None:
            self._fetcher.release()
        self.window, self.chunk = 0, self.chunk + 1
        if self.chunk == len(self.chunks):
            self.epoch, self.chunk = self.epoch + 1, 0

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        out = np.empty((self.batch_size, self.seq_len + 1), dtype=np.int64)  # (B, T+1)
        filled, cursor = 0, (self.epoch, self.chunk, self.window)
        try:
            while filled < self.batch_size:
                tokens, windows = self._take_chunk()
                take = windows[self.window : self.window + self.batch_size - filled]
                out[filled : filled + len(take)] = tokens[take[:, None] * self.seq_len + self._arange]
                filled += len(take)
                self.window += len(take)
                if self.window == len(windows):
                    self._finish_chunk()
        except BaseException:  # a failed fetch: the batch is not handed out, the next call reads it again
            self._stop_fetcher()
            self.epoch, self.chunk, self.window = cursor
            raise
        batch = torch.from_numpy(out)
        return batch[:, :-1].contiguous(), batch[:, 1:].contiguous()  # (B, T), (B, T)

    # ---- progress ----

    @property
    def tokens_per_batch(self) -> int:
        return self.batch_size * self.seq_len

    def _windows_read_this_epoch(self) -> int:
        order, before = self._order()
        return int(before[self.chunk]) + self.window

    @property
    def epochs_read(self) -> float:
        """Passes over this learner's chunks so far: whole epochs plus the share of this epoch's windows read."""
        return self.epoch + self._windows_read_this_epoch() / self.total_windows

    @property
    def tokens_consumed(self) -> int:
        """Tokens of the windows handed out so far (seq_len per window), across epochs and resumes."""
        return (self.epoch * self.total_windows + self._windows_read_this_epoch()) * self.seq_len

    @property
    def chunks_released(self) -> int:
        """Chunks the consumer finished with since the read-ahead thread (re)started (for instrumentation)."""
        return self._fetcher.released if self._fetcher is not None else 0

    # ---- cursor ----

    def state_dict(self) -> dict[str, Any]:
        return {
            "format": CURSOR_FORMAT,
            "seed": self.seed,
            "epoch": self.epoch,
            "chunk": self.chunk,
            "window": self.window,
            "seq_len": self.seq_len,
            "assignment": self.fingerprint,
        }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        missing = {"format", "seed", "epoch", "chunk", "window", "seq_len", "assignment"} - d.keys()
        if missing or d.get("format") != CURSOR_FORMAT:
            raise ValueError(
                f"data cursor lacks {sorted(missing) or ['format ' + CURSOR_FORMAT]}; it was not written by "
                "StreamLoader.state_dict()"
            )
        for key, mine in (("seq_len", self.seq_len), ("assignment", self.fingerprint)):
            if d[key] != mine:
                raise ValueError(
                    f"data cursor was saved with {key}={d[key]} but this loader has {key}={mine}; it belongs "
                    "to another token assignment or run and cannot be resumed here"
                )
        seed, epoch, chunk, window = int(d["seed"]), int(d["epoch"]), int(d["chunk"]), int(d["window"])
        if epoch < 0 or not 0 <= chunk < len(self.chunks):
            raise ValueError(f"data cursor {d} points outside this loader's {len(self.chunks)} chunks")
        i = int(_rng(seed, epoch).permutation(len(self.chunks))[chunk])
        if not 0 <= window < self._windows[i]:
            raise ValueError(f"data cursor {d} points outside chunk {chunk}'s {self._windows[i]} windows")
        self._stop_fetcher()
        self.seed, self.epoch, self.chunk, self.window = seed, epoch, chunk, window
        self._order_cache = None  # the seed may have changed

    # ---- lifetime ----

    def _start_fetcher(self) -> ReadAhead:
        """A read-ahead thread from the cursor; it holds no reference to the loader, so a loader dropped
        without close() is collected and its finalizer stops the thread."""
        store, files, chunks, seed, n = self.store, self.files, self.chunks, self.seed, len(self.chunks)

        def read(i: int) -> np.ndarray:
            f, start, count = chunks[i]
            return read_tokens(store, files[f], start, count)

        order = memo(lambda epoch: _rng(seed, epoch).permutation(n))
        fetcher = ReadAhead(read, order, (self.epoch, self.chunk), self.read_ahead + 1)
        self._finalizer = weakref.finalize(self, fetcher.close, 0.0)
        return fetcher

    def _stop_fetcher(self) -> None:
        if self._fetcher is not None:
            self._finalizer.detach()
            self._fetcher.close()
        self._fetcher, self._current = None, None

    def close(self) -> None:
        """Stop the read-ahead thread and drop the chunks it holds; next_batch would start it again."""
        self._stop_fetcher()

    def __enter__(self) -> StreamLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
