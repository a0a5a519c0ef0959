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
- Three stages with all state in the store (`plan.json`, unit records, the manifest), so the pipeline can
  run them as separate steps: plan, one step per input file (a ParallelFor), finish.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
from typing import Any

from ddiloco.data.textcorpus.inputs import MAX_OBJECT_BYTES, fingerprint, is_local, list_inputs
from ddiloco.data.textcorpus.npyparts import token_dtype
from ddiloco.data.textcorpus.runner import Runner
from ddiloco.data.textcorpus.unit import done_record, run_unit
from ddiloco.data.tokenizer import Tokenizer, tokenizer_from_json
from ddiloco.errors import CorpusError
from ddiloco.store.base import Store

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
DEFAULT_SHARD_TOKENS = 1 << 25
"""Tokens per part: 64 MiB of uint16 (128 MiB of uint32), the bulk of a worker's memory."""
MANIFEST = "manifest.json"
PLAN = "plan.json"
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
    content-addressed prefix of `out_store` below `out_prefix` ('' for the store's root); reuse them if done.
    The three stages (`plan_corpus`, one `run_planned_unit` per file, `finish_corpus`) are what the pipeline's
    tokenize steps run one by one (the units as a ParallelFor)."""
    t0 = time.monotonic()
    _check_processes(workers, inputs, out_store)
    with Runner(workers) as runner:
        plan = plan_corpus(
            inputs,
            out_store,
            out_prefix,
            tokenizer,
            shard_tokens=shard_tokens,
            field=field,
            max_object_bytes=max_object_bytes,
            runner=runner,
        )
        hash_seconds = time.monotonic() - t0
        if plan["reused"]:
            found = out_store.get_json(f"{plan['prefix']}/{MANIFEST}", max_bytes=_MANIFEST_MAX_BYTES)
            return TokenizedCorpus(
                plan["url"], plan["prefix"], found, True, workers, time.monotonic() - t0, hash_seconds
            )
        tok_json = tokenizer.to_json()
        common = {"field": field, "shard_tokens": shard_tokens, "max_object_bytes": max_object_bytes}
        by_size = sorted(plan["units"], key=lambda i: -plan["inputs"][i]["size"])
        records = runner.map(
            "tokenize_file",
            lambda src, name, _url, pre, unit, _tok, **kw: run_unit(
                src, name, out_store, pre, unit, tokenizer, **kw
            ),
            [
                ((inputs, f["name"], out_store.url, plan["prefix"], i, tok_json), common)
                for i, f in enumerate(plan["inputs"])
            ],
            order=by_size,
        )
    manifest = finish_corpus(out_store, plan["prefix"], tokenizer)
    ran = [r for r in records if not r["skipped"]]
    result = TokenizedCorpus(
        plan["url"],
        plan["prefix"],
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
        plan["url"],
        result.seconds,
    )
    return result


def plan_corpus(
    inputs: str,
    out_store: Store,
    out_prefix: str,
    tokenizer: Tokenizer,
    *,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    field: str = "text",
    max_object_bytes: int = MAX_OBJECT_BYTES,
    runner: Runner | None = None,
) -> dict[str, Any]:
    """Stage 1: list and fingerprint the inputs, find the content address; unless its manifest exists
    (`reused`), write the tokenizer and `plan.json` there. The plan names one unit per input file."""
    if shard_tokens < 1:
        raise CorpusError(f"shard_tokens must be positive, got {shard_tokens}")
    token_dtype(tokenizer.vocab_size)  # refuses a vocabulary no dtype holds
    files = list_inputs(inputs)
    by_size = sorted(range(len(files)), key=lambda i: -files[i].size)
    kw = {"max_object_bytes": max_object_bytes}
    jobs = [((inputs, f.name), kw) for f in files]
    if runner is None:
        digests = [fingerprint(*a, **k) for a, k in jobs]
    else:
        digests = runner.map("fingerprint", fingerprint, jobs, order=by_size)
    described = [{"name": f.name, "size": f.size, "sha256": d} for f, d in zip(files, digests, strict=True)]
    tok_json = tokenizer.to_json()
    tok_sha = hashlib.sha256(tok_json.encode()).hexdigest()
    key = corpus_key(described, tok_sha, field, shard_tokens)
    prefix = "/".join(p for p in (out_prefix.strip("/"), f"corpus-{key}") if p)
    plan = {
        "url": f"{out_store.url}/{prefix}",
        "prefix": prefix,
        "key": key,
        "source": inputs,
        "inputs": described,
        "field": field,
        "shard_tokens": shard_tokens,
        "max_object_bytes": max_object_bytes,
        "tokenizer_sha256": tok_sha,
    }
    if out_store.exists(_at(prefix, MANIFEST)):
        log.info("reusing the tokens at %s (manifest found): nothing tokenized", plan["url"])
        return {**plan, "reused": True, "units": []}
    out_store.put(_at(prefix, TOKENIZER), tok_json.encode())
    out_store.put_json(_at(prefix, PLAN), plan)
    return {**plan, "reused": False, "units": list(range(len(files)))}


def _at(prefix: str, name: str) -> str:
    return f"{prefix}/{name}" if prefix else name


def run_planned_unit(out_store: Store, prefix: str, unit: int) -> dict[str, Any]:
    """Stage 2, one per input file (a ParallelFor iteration): tokenize unit `unit` of the plan at `prefix`."""
    plan = out_store.get_json(_at(prefix, PLAN), max_bytes=_MANIFEST_MAX_BYTES)
    tok_json = out_store.get(_at(prefix, TOKENIZER), max_bytes=_MANIFEST_MAX_BYTES).decode()
    name = plan["inputs"][unit]["name"]
    return run_unit(
        plan["source"],
        name,
        out_store,
        prefix,
        unit,
        tokenizer_from_json(tok_json),
        field=plan["field"],
        shard_tokens=plan["shard_tokens"],
        max_object_bytes=plan["max_object_bytes"],
    )


def finish_corpus(out_store: Store, prefix: str, tokenizer: Tokenizer | None = None) -> dict[str, Any]:
    """Stage 3: once every unit is done, write the manifest (write-once) and return it."""
    found = out_store.get_json_or_none(_at(prefix, MANIFEST), max_bytes=_MANIFEST_MAX_BYTES)
    if found is not None:
        return found
    plan = out_store.get_json(_at(prefix, PLAN), max_bytes=_MANIFEST_MAX_BYTES)
    tok_json = out_store.get(_at(prefix, TOKENIZER), max_bytes=_MANIFEST_MAX_BYTES).decode()
    tokenizer = tokenizer or tokenizer_from_json(tok_json)
    records = []
    for unit, f in enumerate(plan["inputs"]):
        record = done_record(out_store, prefix, unit, f["name"])
        if record is None:
            raise CorpusError(
                f"unit {unit} ({f['name']}) of {plan['url']} is not tokenized yet; run it first"
            )
        records.append(record)
    if not any(r["documents"] for r in records):
        raise CorpusError(
            f"input {plan['source']!r} contains no text (all files, lines or fields are empty); check --field"
        )
    dtype = token_dtype(tokenizer.vocab_size).name
    manifest = build_manifest(
        plan["inputs"],
        records,
        tokenizer,
        tok_json,
        plan["tokenizer_sha256"],
        dtype,
        plan["field"],
        plan["shard_tokens"],
        plan["key"],
    )
    if not out_store.create_json(_at(prefix, MANIFEST), manifest):
        log.info("another run wrote the manifest of %s first; using it", plan["url"])
        manifest = out_store.get_json(_at(prefix, MANIFEST), max_bytes=_MANIFEST_MAX_BYTES)
    return manifest


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
