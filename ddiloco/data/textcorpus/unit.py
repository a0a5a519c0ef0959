"""One unit of work: tokenize ONE input file into `.npy` parts and a unit record (a KFP ParallelFor body).

Design choices:
- `tokenize_file` takes strings and ints only (source, file name, output store URL, corpus prefix, unit
  number, tokenizer JSON), so a ParallelFor over files or a spawned worker process can call it with
  nothing pickled but plain values; `run_unit` is the same with live objects, for in-process use.
- Documents are encoded in batches of about `BATCH_BYTES` of text (`encode_batch`; raw bytes for the byte
  tokenizer, vectorised), each followed by the eos id as in `ddiloco.data.loader.tokenize_corpus`, and appended
  to a `PartWriter`: memory is one batch plus one part buffer, whatever the file's size.
- The unit record `units/{unit:06d}.json` is written after the unit's parts: its presence (with every part
  it names present) means the unit is done, and a rerun after a crash skips it. A unit without a record
  is redone from the start; parts are cut deterministically, so it rewrites the same keys.
- The record carries the worker's pid and peak RSS (VmHWM, else `resource.getrusage`), for the memory
  bound.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from ddiloco.data.textcorpus.formats import iter_documents
from ddiloco.data.textcorpus.inputs import MAX_OBJECT_BYTES, open_input, where
from ddiloco.data.textcorpus.npyparts import PartWriter, token_dtype
from ddiloco.data.tokenizer import ByteTokenizer, Tokenizer, tokenizer_from_json
from ddiloco.platform.procinfo import peak_rss_bytes
from ddiloco.store.base import Store

log = logging.getLogger(__name__)

BATCH_BYTES = 4 << 20
"""Text per `encode_batch` call (and the most a batch holds besides one document larger than that)."""
_tokenizers: dict[str, Tokenizer] = {}


def unit_record_key(prefix: str, unit: int) -> str:
    return f"{prefix}/units/{unit:06d}.json"


def tokenize_file(
    source: str, name: str, out_url: str, prefix: str, unit: int, tokenizer_json: str, **options: Any
) -> dict[str, Any]:
    """Tokenize file `name` of `source` into parts under `prefix` of the store at `out_url`; its record.
    `options`: `run_unit`'s keywords (`field`, `shard_tokens`, `max_object_bytes`), plain values too."""
    from ddiloco.store.url import open_store

    return run_unit(source, name, open_store(out_url), prefix, unit, _tokenizer(tokenizer_json), **options)


def _tokenizer(tokenizer_json: str) -> Tokenizer:
    """The tokenizer of this JSON, built once per process."""
    digest = hashlib.sha256(tokenizer_json.encode()).hexdigest()
    if digest not in _tokenizers:
        _tokenizers.clear()
        _tokenizers[digest] = tokenizer_from_json(tokenizer_json)
    return _tokenizers[digest]


def done_record(store: Store, prefix: str, unit: int, name: str) -> dict[str, Any] | None:
    """The unit's record if the unit is complete (its record names this file and all its parts exist)."""
    record = store.get_json_or_none(unit_record_key(prefix, unit))
    if not isinstance(record, dict) or record.get("name") != name:
        return None
    if not all(store.exists(f"{prefix}/{p['key']}") for p in record.get("parts", ())):
        return None
    return record


def run_unit(
    source: str,
    name: str,
    store: Store,
    prefix: str,
    unit: int,
    tokenizer: Tokenizer,
    *,
    field: str = "text",
    shard_tokens: int,
    max_object_bytes: int = MAX_OBJECT_BYTES,
) -> dict[str, Any]:
    """`tokenize_file` with a live store and tokenizer; skipped (its record returned) if already done."""
    record = done_record(store, prefix, unit, name)
    if record is not None:
        log.info(
            "unit %d (%s) already tokenized: %d tokens in %d parts, skipped",
            unit,
            name,
            record["tokens"],
            len(record["parts"]),
        )
        return {**record, "skipped": True}
    t0 = time.monotonic()
    at = where(source, name)
    writer = PartWriter(store, prefix, unit, token_dtype(tokenizer.vocab_size), shard_tokens)
    documents = characters = 0
    with open_input(source, name, max_object_bytes=max_object_bytes) as stream:
        for batch in _batches(iter_documents(stream, at, field)):
            writer.add(encode_documents(tokenizer, batch))
            documents += len(batch)
            characters += sum(len(t) for t in batch)
    parts = writer.close()
    record = {
        "unit": unit,
        "name": name,
        "documents": documents,
        "characters": characters,
        "tokens": writer.tokens,
        "parts": parts,
        "seconds": round(time.monotonic() - t0, 3),
        "pid": os.getpid(),
        "peak_rss_bytes": peak_rss_bytes() or 0,
    }
    store.put_json(unit_record_key(prefix, unit), record)  # last: the unit is done
    log.info(
        "unit %d (%s): %d documents, %d tokens, %d parts in %.1fs",
        unit,
        name,
        documents,
        writer.tokens,
        len(parts),
        record["seconds"],
    )
    return {**record, "skipped": False}


def _batches(docs: Iterator[str]) -> Iterator[list[str]]:
    batch: list[str] = []
    size = 0
    for doc in docs:
        batch.append(doc)
        size += len(doc)
        if size >= BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def encode_documents(tokenizer: Tokenizer, texts: list[str]) -> np.ndarray:
    """The documents' ids, each followed by eos, as one int64 array (ids as `tokenize_corpus` makes them)."""
    eos = tokenizer.eos_id
    if type(tokenizer) is ByteTokenizer:  # fast path: no Python int per byte
        data = [t.encode("utf-8") for t in texts]
        lengths = np.fromiter((len(d) for d in data), dtype=np.int64, count=len(data))
        out = np.empty(int(lengths.sum()) + len(data), dtype=np.int64)
        eos_at = np.cumsum(lengths + 1) - 1
        is_eos = np.zeros(out.size, dtype=bool)
        is_eos[eos_at] = True
        out[~is_eos] = np.frombuffer(b"".join(data), dtype=np.uint8)
        out[is_eos] = eos
        return out
    flat: list[int] = []
    for ids in tokenizer.encode_batch(texts):
        flat.extend(ids)
        flat.append(eos)
    return np.asarray(flat, dtype=np.int64)
