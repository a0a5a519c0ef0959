"""A corpus of `.npy` token files under a store prefix: its files, a vocabulary check and its manifest.

Design choices:
- A local directory is a file store (`ddiloco.store.url.open_store` takes a plain path, file:// or s3://);
  `TokenCorpus.open(store, prefix)` lists the `*.npy` objects under the prefix with their sizes (one
  listing) and reads each header with one range read; files are in sorted key order, which fixes every
  token's place in the corpus.
- `check_vocab` streams token blocks (`block_tokens` at a time, so memory does not grow with the corpus)
  and stops at the first id >= vocab_size, naming the file and the id. How much it reads is the caller's
  choice: every token (`sample=None`), or `sample` tokens per file as evenly spaced blocks.
- The manifest is a JSON-able dict: per file its key, dtype, token count, data offset, size and a content
  digest (sha256 streamed in blocks; `digest="size-only"` skips reading the data, for quick runs), and the
  total. It is what `ranges` cuts and what `stream` reads: a loader needs no header reads of its own.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from typing import Any

import numpy as np

from ddiloco.data.tokens.npy import CorpusError, TokenFile, read_header, read_tokens
from ddiloco.store.base import Store

logger = logging.getLogger(__name__)

__all__ = ["MANIFEST_FORMAT", "TokenCorpus", "files_of"]

MANIFEST_FORMAT = "ddiloco.data.tokens/1"
BLOCK_TOKENS = 1 << 22
"""Tokens read at a time by the vocabulary check and the digest (8-16 MiB)."""
DIGESTS = ("sha256", "size-only")


@dataclasses.dataclass(frozen=True)
class TokenCorpus:
    """The token files under `prefix` of `store`, in key order (see the module docstring)."""

    store: Store
    prefix: str
    files: tuple[TokenFile, ...]

    @classmethod
    def open(cls, store: Store, prefix: str = "") -> TokenCorpus:
        sizes = {k: n for k, n in store.sizes(prefix).items() if k.endswith(".npy")}
        if not sizes:
            where = f"{store.url}/{prefix}".rstrip("/")
            raise CorpusError(
                f"no .npy token files under {where}; write each part of the tokenized corpus there with "
                f"numpy.save(path, ids.astype(numpy.uint16)) (uint32 for vocabularies over 65536)"
            )
        files = tuple(read_header(store, key, sizes[key]) for key in sorted(sizes))
        corpus = cls(store, prefix, files)
        logger.info(
            "token corpus %s/%s: %d files, %d tokens", store.url, prefix, len(files), corpus.total_tokens
        )
        return corpus

    @property
    def total_tokens(self) -> int:
        return sum(f.count for f in self.files)

    def check_vocab(
        self, vocab_size: int, *, sample: int | None = None, block_tokens: int = BLOCK_TOKENS
    ) -> int:
        """Verify every token id read is < vocab_size; return how many tokens were checked.

        sample: None reads every token; else up to `sample` tokens per file, as evenly spaced blocks of at
        most `block_tokens`. CorpusError names the file, the first offending id and its position."""
        if vocab_size < 1 or block_tokens < 1 or (sample is not None and sample < 0):
            raise ValueError(
                f"vocab_size and block_tokens must be >= 1 and sample >= 0, got {vocab_size}, {block_tokens}, {sample}"
            )
        checked = 0
        for tf in self.files:
            for start, count in _blocks(tf.count, block_tokens, sample):
                ids = read_tokens(self.store, tf, start, count)
                bad = np.flatnonzero(ids >= vocab_size)
                if bad.size:
                    pos = int(bad[0])
                    raise CorpusError(
                        f"{tf.key} holds token id {int(ids[pos])} at position {start + pos}, not below the "
                        f"vocabulary size {vocab_size}; tokenize with the model's tokenizer or raise model.vocab_size"
                    )
                checked += count
        return checked

    def manifest(self, *, digest: str = "sha256") -> dict[str, Any]:
        """The JSON-able manifest: files (key, dtype, count, data_offset, size_bytes, digest) and total_tokens."""
        if digest not in DIGESTS:
            raise ValueError(f"digest must be one of {DIGESTS}, got {digest!r}")
        files = []
        for tf in self.files:
            entry = tf.to_json()
            entry["digest"] = self._sha256(tf) if digest == "sha256" else f"size:{tf.size_bytes}"
            files.append(entry)
        return {
            "format": MANIFEST_FORMAT,
            "store": self.store.url,
            "prefix": self.prefix,
            "files": files,
            "total_tokens": self.total_tokens,
        }

    def _sha256(self, tf: TokenFile, block_bytes: int = 8 << 20) -> str:
        h = hashlib.sha256()
        for offset in range(0, tf.size_bytes, block_bytes):
            data = self.store.get_range(tf.key, offset, block_bytes)
            if len(data) != min(block_bytes, tf.size_bytes - offset):
                raise CorpusError(f"{tf.key} changed while its digest was computed; rebuild the manifest")
            h.update(data)
        return f"sha256:{h.hexdigest()}"


def _blocks(n: int, block: int, sample: int | None) -> list[tuple[int, int]]:
    """(start, count) token blocks of a file of n tokens: all of them, or `sample` tokens as blocks spread
    evenly from the file's first token to its last."""
    if sample is None or sample >= n:
        return [(s, min(block, n - s)) for s in range(0, n, block)]
    k = -(-sample // block)  # blocks needed
    sizes = [block] * (k - 1) + [sample - block * (k - 1)]
    gap = (n - sample) / max(1, k - 1)
    return [(i * block + int(i * gap), sizes[i]) for i in range(k)]


def files_of(corpus_or_manifest: TokenCorpus | dict[str, Any]) -> tuple[TokenFile, ...]:
    """The token files of a corpus or of its manifest (CorpusError if the manifest is not one)."""
    if isinstance(corpus_or_manifest, TokenCorpus):
        return corpus_or_manifest.files
    if not isinstance(corpus_or_manifest, dict) or corpus_or_manifest.get("format") != MANIFEST_FORMAT:
        raise CorpusError(
            f"not a token corpus manifest (format {MANIFEST_FORMAT!r} expected); build it with TokenCorpus.manifest()"
        )
    return tuple(TokenFile.from_json(d) for d in corpus_or_manifest["files"])
