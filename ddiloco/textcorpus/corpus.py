"""`tokenize_to_npy`: a corpus of input files -> a content-addressed prefix of `.npy` token parts + manifest.

Design choices:
- The corpus prefix is `{out_prefix}/corpus-{key}`, key the sha256 (first 24 hex) of the input files'
  names, sizes and content sha256s, the tokenizer's fingerprint (sha256 of its `to_json()`), the text
  field, the part size and `FORMAT_VERSION`: whatever changes the bytes written gives a new prefix, and
  the same data and tokenizer find the same one.
- `manifest.json` is written last, with `create` (atomic, write-once); its content is deterministic, so
  racing runs write identical bytes. If it exists the tokens are reused and nothing is tokenized. Without
  it, every unit (input file) whose record and parts exist is skipped, so a crashed run resumes.
- The tokenizer's own JSON is stored beside the parts (`tokenizer.json`), so the tokens can be decoded.
- Hashing and tokenizing both run per file on the same `Runner` (inline, or spawned worker processes).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
from typing import Any

from ddiloco.store.base import Store
from ddiloco.textcorpus.errors import CorpusError
from ddiloco.textcorpus.inputs import MAX_OBJECT_BYTES, fingerprint, is_local, list_inputs
from ddiloco.textcorpus.npyparts import token_dtype
from ddiloco.textcorpus.runner import Runner
from ddiloco.textcorpus.unit import run_unit
from ddiloco.tokenizer import Tokenizer

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
DEFAULT_SHARD_TOKENS = 1 << 25
"""Tokens per part: 64 MiB of uint16 (128 MiB of uint32), the bulk of a worker's memory."""
MANIFEST = "manifest.json"
TOKENIZER = "tokenizer.json"
_MANIFEST_MAX_BYTES = 256 << 20


@dataclasses.dataclass
class TokenizedCorpus:
    """Where the tokens are and what producing (or finding) them took (`seconds`: the whole call, hashing
    the inputs included; the per-worker rates in `summary` divide by it)."""

    url: str
    prefix: str
    manifest: dict[str, Any]
    reused: bool
    workers: int
    seconds: float
    hash_seconds: float
    units_skipped: int = 0
    peak_rss_bytes: dict[int, int] = dataclasses.field(default_factory=dict)
    """pid -> peak RSS of each process that tokenized a unit in this run."""

    def summary(self) -> dict[str, Any]:
        m, secs = self.manifest, max(self.seconds, 1e-9)
        return {
            "url": self.url,
            "prefix": self.prefix,
            "reused": self.reused,
            "documents": m["documents"],
            "tokens": m["tokens"],
            "bytes_in": m["bytes_in"],
            "parts": len(m["parts"]),
            "dtype": m["dtype"],
            "workers": self.workers,
            "seconds": round(self.seconds, 3),
            "hash_seconds": round(self.hash_seconds, 3),
            "documents_per_s": round(m["documents"] / secs, 1),
            "mb_per_s_per_worker": round(m["bytes_in"] / 1e6 / secs / self.workers, 2),
            "units_skipped": self.units_skipped,
            "peak_rss_mb_per_worker": round(max(self.peak_rss_bytes.values(), default=0) / 2**20, 1),
        }


def tokenizer_fingerprint(tokenizer: Tokenizer) -> str:
    return hashlib.sha256(tokenizer.to_json().encode()).hexdigest()


def corpus_key(inputs: list[dict[str, Any]], tokenizer_sha: str, field: str, shard_tokens: int) -> str:
    """The content address of a corpus: see the module docstring."""
    what = {
        "format": FORMAT_VERSION,
        "inputs": [[f["name"], f["size"], f["sha256"]] for f in inputs],
        "tokenizer": tokenizer_sha,
        "field": field,
        "shard_tokens": shard_tokens,
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:24]


def tokenize_to_npy(
    inputs: str,
    out_store: Store,
    out_prefix: str,
    tokenizer: Tokenizer,
    *,
    workers: int = 1,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    field: str = "text",
    max_object_bytes: int = MAX_OBJECT_BYTES,
) -> TokenizedCorpus:
    """Tokenize every supported file of `inputs` (a path or store URL) into `.npy` parts under a
    content-addressed prefix of `out_store` below `out_prefix` ('' for the store's root); reuse them if done."""
    t0 = time.monotonic()
    dtype = token_dtype(tokenizer.vocab_size)
    if shard_tokens < 1:
        raise CorpusError(f"shard_tokens must be positive, got {shard_tokens}")
    _check_processes(workers, inputs, out_store)
    files = list_inputs(inputs)
    by_size = sorted(range(len(files)), key=lambda i: -files[i].size)
    tok_json = tokenizer.to_json()
    tok_sha = hashlib.sha256(tok_json.encode()).hexdigest()
    with Runner(workers) as runner:
        kw = {"max_object_bytes": max_object_bytes}
        digests = runner.map(
            "fingerprint", fingerprint, [((inputs, f.name), kw) for f in files], order=by_size
        )
        hash_seconds = time.monotonic() - t0
        described = [
            {"name": f.name, "size": f.size, "sha256": d} for f, d in zip(files, digests, strict=True)
        ]
        key = corpus_key(described, tok_sha, field, shard_tokens)
        prefix = "/".join(p for p in (out_prefix.strip("/"), f"corpus-{key}") if p)
        url = f"{out_store.url}/{prefix}"
        found = out_store.get_json_or_none(f"{prefix}/{MANIFEST}", max_bytes=_MANIFEST_MAX_BYTES)
        if found is not None:
            log.info("reusing %d tokens at %s (manifest found): nothing tokenized", found["tokens"], url)
            return TokenizedCorpus(url, prefix, found, True, workers, time.monotonic() - t0, hash_seconds)
        out_store.put(f"{prefix}/{TOKENIZER}", tok_json.encode())
        common = {"field": field, "shard_tokens": shard_tokens, "max_object_bytes": max_object_bytes}
        records = runner.map(
            "tokenize_file",
            lambda src, name, _url, pre, unit, _tok, **kw: run_unit(
                src, name, out_store, pre, unit, tokenizer, **kw
            ),
            [((inputs, f.name, out_store.url, prefix, i, tok_json), common) for i, f in enumerate(files)],
            order=by_size,
        )
    if not any(r["documents"] for r in records):
        raise CorpusError(
            f"input {inputs!r} contains no text (all files, lines or fields are empty); check --field"
        )
    manifest = build_manifest(
        described, records, tokenizer, tok_json, tok_sha, dtype.name, field, shard_tokens, key
    )
    if not out_store.create_json(f"{prefix}/{MANIFEST}", manifest):
        log.info("another run wrote the manifest of %s first; using it", url)
        manifest = out_store.get_json(f"{prefix}/{MANIFEST}", max_bytes=_MANIFEST_MAX_BYTES)
    ran = [r for r in records if not r["skipped"]]
    result = TokenizedCorpus(
        url,
        prefix,
        manifest,
        False,
        workers,
        time.monotonic() - t0,
        hash_seconds,
        units_skipped=len(records) - len(ran),
        peak_rss_bytes={
            pid: max(r["peak_rss_bytes"] for r in ran if r["pid"] == pid) for pid in {r["pid"] for r in ran}
        },
    )
    log.info(
        "tokenized %d documents into %d tokens in %d parts at %s (%.1fs)",
        manifest["documents"],
        manifest["tokens"],
        len(manifest["parts"]),
        url,
        result.seconds,
    )
    return result


def build_manifest(
    inputs: list[dict[str, Any]],
    records: list[dict[str, Any]],
    tokenizer: Tokenizer,
    tok_json: str,
    tok_sha: str,
    dtype: str,
    field: str,
    shard_tokens: int,
    key: str,
) -> dict[str, Any]:
    """What the corpus prefix holds (parts in corpus order, counts, inputs, tokenizer): deterministic."""
    files = [
        {**f, "documents": r["documents"], "tokens": r["tokens"], "parts": [p["key"] for p in r["parts"]]}
        for f, r in zip(inputs, records, strict=True)
    ]
    return {
        "format_version": FORMAT_VERSION,
        "key": key,
        "dtype": dtype,
        "byte_order": "little",
        "shard_tokens": shard_tokens,
        "field": field,
        "tokenizer": {
            "sha256": tok_sha,
            "file": TOKENIZER,
            "vocab_size": tokenizer.vocab_size,
            "eos_id": tokenizer.eos_id,
            "type": json.loads(tok_json).get("type"),
        },
        "documents": sum(r["documents"] for r in records),
        "tokens": sum(r["tokens"] for r in records),
        "bytes_in": sum(f["size"] for f in inputs),
        "characters": sum(r["characters"] for r in records),
        "inputs": files,
        "parts": [p for r in records for p in r["parts"]],
    }


def _check_processes(workers: int, inputs: str, out_store: Store) -> None:
    """memory:// stores live in one process: refuse them with worker processes."""
    if workers > 1 and (
        out_store.url.startswith("memory://") or (not is_local(inputs) and inputs.startswith("memory://"))
    ):
        raise CorpusError(
            "a memory:// store lives in one process and worker processes cannot see it; use --workers 1 "
            "or a file:// or s3:// store"
        )
