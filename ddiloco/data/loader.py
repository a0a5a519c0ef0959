"""Corpora on disk -> token stream -> validation split + disjoint learner shards -> resumable batches.

`load_texts` reads .txt/.md files (one document), .jsonl files (one document per line) or a directory of
those; every failure is one line naming the file and what to do. The corpus is one 1-D int32 tensor, each
document followed by the eos id, so a model learns where documents end. `split_tokens` holds out validation
from the end of the stream and cuts the rest into contiguous, disjoint shards, one per learner id the run
may have (`ddiloco.data.shards`). `ShardLoader` draws windows of seq_len + 1 tokens from a grid whose offset and
order come from (seed, epoch), so the cursor (epoch, index) is all a restarted learner needs to continue
exactly. `val_batches` uses fixed windows: the same numbers every time.

Design notes: docs/internals.md, "From text files to shards and batches".
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from ddiloco.data.tokenizer import ByteTokenizer, Tokenizer

logger = logging.getLogger(__name__)

TEXT_SUFFIXES = (".txt", ".md")
CORPUS_SUFFIXES = (*TEXT_SUFFIXES, ".jsonl")


def load_texts(source: str, *, jsonl_field: str = "text") -> list[str]:
    """Documents from a .txt/.md/.jsonl file or a directory of them."""
    path = Path(source).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"corpus {source!r} does not exist; pass a .txt/.md/.jsonl file, a directory, or 'synthetic'"
        )
    if path.is_dir():
        files = sorted(
            (p for p in path.rglob("*") if p.suffix in CORPUS_SUFFIXES and p.is_file()),
            key=lambda p: p.relative_to(path).as_posix(),
        )
        files = [p for p in files if not any(part.startswith(".") for part in p.relative_to(path).parts)]
        if not files:
            raise ValueError(f"corpus directory {source!r} holds no {'/'.join(CORPUS_SUFFIXES)} files")
    elif path.suffix in CORPUS_SUFFIXES:
        files = [path]
    else:
        raise ValueError(
            f"corpus file {source!r} has an unsupported extension; use {', '.join(CORPUS_SUFFIXES)} or a directory"
        )
    texts: list[str] = []
    for f in files:
        texts.extend(_read_jsonl(f, jsonl_field) if f.suffix == ".jsonl" else [_read_text(f)])
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise ValueError(f"corpus {source!r} contains no text (all files or fields are empty)")
    logger.info("loaded %d documents (%d characters) from %s", len(texts), sum(map(len, texts)), source)
    return texts


def _read_text(path: Path) -> str:
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ValueError(f"{path}: cannot read ({e.strerror}); check its permissions") from e
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{path}: not UTF-8 text (bad byte at offset {e.start}); convert it or remove it"
        ) from e


def iter_jsonl(path: Path) -> Iterator[tuple[str, dict]]:
    """("file:line", object) for every non-blank line; a line that is not a JSON object is an error."""
    for lineno, line in enumerate(_read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: invalid JSON ({e.msg}); each line must be one JSON object") from e
        if not isinstance(obj, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        yield where, obj


def _read_jsonl(path: Path, field: str) -> list[str]:
    texts = []
    for where, obj in iter_jsonl(path):
        if field not in obj:
            raise ValueError(f"{where}: no field {field!r} (fields: {sorted(obj)}); set the JSONL text field")
        value = obj[field]
        if not isinstance(value, str):
            raise ValueError(f"{where}: field {field!r} must be a string, got {type(value).__name__}")
        texts.append(value)
    return texts


def tokenize_corpus(texts: Sequence[str], tokenizer: Tokenizer) -> torch.Tensor:
    """All documents as one int32 token stream, each followed by eos."""
    if isinstance(tokenizer, ByteTokenizer):  # fast path: no Python list per byte
        parts = [np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(np.int32) for t in texts]
    else:
        parts = [np.asarray(ids, dtype=np.int32) for ids in tokenizer.encode_batch(list(texts))]
    eos = np.array([tokenizer.eos_id], dtype=np.int32)
    stream = np.concatenate([x for part in parts for x in (part, eos)]) if parts else np.zeros(0, np.int32)
    logger.info("tokenized %d documents into %d tokens", len(parts), stream.size)
    return torch.from_numpy(stream)


def split_tokens(
    tokens: torch.Tensor, *, num_shards: int, val_fraction: float, min_shard_tokens: int = 2
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """(num_shards disjoint contiguous training shards, validation tokens held out from the end).

    min_shard_tokens: the fewest tokens a shard may have; pass batch_size * seq_len + 1 for one batch.
    """
    if tokens.dim() != 1:
        raise ValueError(f"expected a 1-D token stream, got shape {tuple(tokens.shape)}")
    if num_shards < 1:
        raise ValueError(f"num_shards must be at least 1, got {num_shards}")
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    n = tokens.numel()
    n_val = round(n * val_fraction)
    if val_fraction > 0 and n_val < 2:
        raise ValueError(f"val_fraction={val_fraction} of {n} tokens leaves no validation data; raise it")
    train, val = tokens[: n - n_val], tokens[n - n_val :]
    shards = list(torch.tensor_split(train, num_shards))
    smallest = min(s.numel() for s in shards)
    if smallest < min_shard_tokens:
        raise ValueError(
            f"{n - n_val} training tokens split {num_shards} ways gives shards of {smallest} tokens, fewer than "
            f"the {min_shard_tokens} needed; use a larger corpus, fewer shards, or a smaller batch / seq_len"
        )
    return [s.clone() for s in shards], val.clone()


class ShardLoader:
    """Deterministic, resumable (x, y) batches of shape (batch_size, seq_len) from one shard."""

    def __init__(self, tokens: torch.Tensor, *, batch_size: int, seq_len: int, seed: int) -> None:
        if tokens.dim() != 1:
            raise ValueError(f"expected a 1-D token shard, got shape {tuple(tokens.shape)}")
        if batch_size < 1 or seq_len < 1:
            raise ValueError(f"batch_size and seq_len must be positive, got {batch_size} and {seq_len}")
        need = batch_size * seq_len + 1
        if tokens.numel() < need:
            raise ValueError(
                f"shard has {tokens.numel()} tokens, fewer than one batch needs ({batch_size} x {seq_len} + 1 = "
                f"{need}); use a larger corpus, fewer shards, or a smaller batch_size / seq_len"
            )
        self.tokens = tokens  # kept as stored (int32): windows are widened to int64 when read
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.seed = seed
        self.epoch = 0
        self.index = 0
        # Largest grid offset that still leaves batch_size full windows of seq_len + 1 tokens.
        self._max_offset = min(seq_len - 1, tokens.numel() - need)
        self._perm_epoch = -1
        self._starts = np.zeros(0, dtype=np.int64)
        self._arange = torch.arange(seq_len + 1)  # (T+1,)

    @property
    def tokens_per_batch(self) -> int:
        return self.batch_size * self.seq_len

    @property
    def epochs_read(self) -> float:
        """Passes over the shard so far: whole epochs, plus the share of this epoch's windows already read."""
        return self.epoch + self.index / len(self._epoch_starts())

    def _epoch_starts(self) -> np.ndarray:
        """Window starts of the current epoch, in this epoch's order."""
        if self._perm_epoch != self.epoch:
            rng = np.random.default_rng([self.seed % 2**64, self.epoch])  # SeedSequence wants ints >= 0
            offset = int(rng.integers(0, self._max_offset + 1))
            n_windows = (self.tokens.numel() - 1 - offset) // self.seq_len
            self._starts = offset + rng.permutation(n_windows) * self.seq_len
            self._perm_epoch = self.epoch
        return self._starts

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts: list[int] = []
        while len(starts) < self.batch_size:
            epoch_starts = self._epoch_starts()
            take = epoch_starts[self.index : self.index + self.batch_size - len(starts)]
            starts.extend(int(s) for s in take)
            self.index += len(take)
            if self.index >= len(epoch_starts):
                self.epoch, self.index = self.epoch + 1, 0
        idx = torch.tensor(starts)[:, None] + self._arange  # (B, T+1)
        window = self.tokens[idx].long()  # (B, T+1)
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()  # (B, T), (B, T)

    def close(self) -> None:
        """Nothing to release (the streamed loaders stop their read-ahead thread here)."""

    def state_dict(self) -> dict:
        return {
            "seed": self.seed,
            "epoch": self.epoch,
            "index": self.index,
            "seq_len": self.seq_len,
            "num_tokens": self.tokens.numel(),
        }

    def load_state_dict(self, d: dict) -> None:
        for key, mine in (("seq_len", self.seq_len), ("num_tokens", self.tokens.numel())):
            if key in d and d[key] != mine:
                raise ValueError(
                    f"data cursor was saved with {key}={d[key]} but this loader has {key}={mine}; "
                    "it belongs to another shard or run and cannot be resumed here"
                )
        missing = {"seed", "epoch", "index"} - d.keys()
        if missing:
            raise ValueError(
                f"data cursor lacks {sorted(missing)}; it was not written by ShardLoader.state_dict()"
            )
        self.seed, self.epoch, self.index = int(d["seed"]), int(d["epoch"]), int(d["index"])
        self._perm_epoch = -1  # the seed may have changed: redraw this epoch's order


def val_batches(
    tokens: torch.Tensor, *, batch_size: int, seq_len: int, max_batches: int | None = None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Non-overlapping windows from the start of tokens, batch_size per batch (the last one may be smaller)."""
    n_windows = (tokens.numel() - 1) // seq_len
    if n_windows < 1:
        raise ValueError(
            f"validation split has {tokens.numel()} tokens, fewer than one sequence ({seq_len + 1})"
        )
    if max_batches is not None:
        n_windows = min(n_windows, max_batches * batch_size)
    idx = torch.arange(n_windows)[:, None] * seq_len + torch.arange(seq_len + 1)  # (N, T+1)
    windows = tokens[idx].long()  # (N, T+1)
    return [
        (w[:, :-1].contiguous(), w[:, 1:].contiguous()) for w in windows.split(batch_size)
    ]  # [(B, T), (B, T)]
