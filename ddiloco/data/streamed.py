"""A run over a pre-tokenized corpus: `.npy` token files in a directory or store prefix, read in place.

`data.source` names a token corpus when it is a local directory, `file://` or `s3://` prefix holding `.npy`
files (`ddiloco.data.tokens`); anything else is text, tokenized by prepare. The ids must be the run tokenizer's
(`byte`, `model` or `auto`; `bpe` is refused), and a corpus `ddiloco tokenize` wrote must name that
tokenizer. Prepare checks the ids against the vocabulary (streamed) and copies into the run root only the
validation split and `data/corpus.json` (files, sizes, digests, the range plan of `ddiloco.data.tokens.ranges`).
`data.sources` mixes several corpora with weights (`ddiloco.data.tokens.mixture`). Learner id i streams slot i
with range reads and a bounded read-ahead (`ddiloco.data.tokens.stream`), so its memory does not depend on the
corpus size.

Design notes: docs/internals.md, "Pre-tokenized corpora".
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ddiloco import keys
from ddiloco.config.data import mixture_name
from ddiloco.data.tokenizer import Tokenizer
from ddiloco.data.tokens.corpus import TokenCorpus, files_of
from ddiloco.data.tokens.mixture import MixtureLoader
from ddiloco.data.tokens.npy import CorpusError, read_tokens
from ddiloco.data.tokens.ranges import plan_ranges, slot_chunks
from ddiloco.data.tokens.stream import StreamLoader
from ddiloco.errors import ConfigError
from ddiloco.store.base import Store

log = logging.getLogger(__name__)

MAX_VAL_TOKENS = 1 << 22
"""Validation tokens copied into the run root at most (16 MB as int32), however large the corpus."""
FULL_CHECK_TOKENS = 1 << 32
"""Corpora up to this many tokens have every id checked against the vocabulary at prepare."""
MAX_CORPUS_DOC_BYTES = 64 << 20
TOKENIZED_MANIFEST = "manifest.json"
"""What `ddiloco tokenize` (`ddiloco.data.textcorpus`) writes beside its parts: it names the tokenizer."""


def corpus_store(source: str) -> Store | None:
    """The store holding a token corpus named by `source`, or None when `source` is text (or synthetic)."""
    from ddiloco.store.url import open_store

    if source == "synthetic":
        return None
    is_url = source.startswith(("s3://", "file://"))
    if not is_url and not (Path(source).is_dir() and any(Path(source).rglob("*.npy"))):
        return None
    store = open_store(source)
    return store if any(k.endswith(".npy") for k in store.list("")) else None


@dataclass(frozen=True)
class PreparedCorpus:
    doc: dict[str, Any]
    """data/corpus.json: source, manifest, plan."""
    val: torch.Tensor
    slot_tokens: list[int]


def prepare_corpus(cfg: Any, tok: Tokenizer, store: Store | None = None) -> PreparedCorpus:
    """Check the corpus (`store`: data.source's) or each corpus of the mixture `data.sources` against the
    vocabulary and plan their ranges (see the module docstring)."""
    if cfg.data.tokenizer == "bpe":
        raise ConfigError(
            "the corpus is already tokenized: data.tokenizer=bpe would train a new vocabulary on text; set "
            "data.tokenizer=model (with model.hf) or byte, whichever wrote the ids"
        )
    if not cfg.data.sources:
        assert store is not None
        one = _plan_one(store, cfg.data.source, cfg, tok, MAX_VAL_TOKENS)
        return PreparedCorpus(one.doc, one.val, one.slot_tokens)
    docs, vals, slots = [], [], []
    for i, entry in enumerate(cfg.data.sources):
        where = corpus_store(entry["source"])
        if where is None:
            raise ConfigError(
                f"data.sources[{i}] {entry['source']} holds no .npy token files; tokenize text first with "
                "`ddiloco tokenize --input ... --out ...` and name the corpus-KEY prefix it prints"
            )
        one = _plan_one(where, entry["source"], cfg, tok, MAX_VAL_TOKENS // len(cfg.data.sources))
        docs.append({"name": mixture_name(entry), "weight": float(entry.get("weight", 1.0)), **one.doc})
        vals.append(one.val)
        slots.append(one.slot_tokens)
    slot_tokens = [sum(s[k] for s in slots) for k in range(cfg.num_shards)]
    return PreparedCorpus({"mixture": docs}, torch.cat(vals), slot_tokens)


def _plan_one(store: Store, source: str, cfg: Any, tok: Tokenizer, max_val: int) -> PreparedCorpus:
    corpus = TokenCorpus.open(store)
    _check_tokenizer(store, source, tok)
    total = corpus.total_tokens
    sample = None if total <= FULL_CHECK_TOKENS else FULL_CHECK_TOKENS // len(corpus.files)  # per file
    corpus.check_vocab(tok.vocab_size, sample=sample)
    local = store.url.startswith("file://")
    manifest = corpus.manifest(digest="sha256" if local else "size-only")
    val_tokens = max(cfg.model.seq_len + 1, min(int(total * cfg.data.val_fraction), max_val))
    try:
        plan = plan_ranges(
            manifest,
            num_slots=cfg.num_shards,
            chunk_tokens=cfg.data.chunk_tokens,
            val_tokens=val_tokens,
            seed=cfg.seed,
        )
    except CorpusError as e:
        raise ConfigError(f"data source {source}: {e}") from None
    val = np.concatenate([read_tokens(store, corpus.files[f], s, n) for f, s, n in plan["val"]])
    doc = {"source": source, "manifest": manifest, "plan": plan}
    return PreparedCorpus(doc, torch.from_numpy(val.astype(np.int32)), list(plan["slot_tokens"]))


def _check_tokenizer(store: Store, source: str, tok: Tokenizer) -> None:
    """A corpus written by `ddiloco tokenize` names its tokenizer (manifest.json): it must be the run's."""
    manifest = store.get_json_or_none(TOKENIZED_MANIFEST, max_bytes=MAX_CORPUS_DOC_BYTES)
    theirs = ((manifest or {}).get("tokenizer") or {}).get("sha256")
    if theirs is None:
        return  # written by another tool: the vocabulary check is what can be checked
    if theirs != hashlib.sha256(tok.to_json().encode()).hexdigest():
        raise ConfigError(
            f"{source} was tokenized with another tokenizer (vocabulary {manifest['tokenizer'].get('vocab_size')}, "
            f"{manifest['tokenizer'].get('type')}) than this run's ({tok!r}); set data.tokenizer / model.hf to the "
            "one `ddiloco tokenize` used, or tokenize the text again with this run's"
        )


def read_corpus_doc(run_store: Store) -> dict[str, Any]:
    return run_store.get_json(keys.CORPUS, max_bytes=MAX_CORPUS_DOC_BYTES)


def open_loader(
    doc: dict[str, Any],
    slot: int,
    *,
    batch_size: int,
    seq_len: int,
    seed: int,
    part: tuple[int, int] = (0, 1),
) -> StreamLoader | MixtureLoader:
    """Learner slot `slot`'s batches, streamed from the corpus (or the mixture) `doc` names (data/corpus.json);
    `part` = (rank, ranks): a DDP rank's share, every ranks-th chunk of the slot from the rank-th."""
    shape = {"batch_size": batch_size, "seq_len": seq_len, "seed": seed}

    def share(plan: dict[str, Any]) -> list[list[int]]:
        rank, ranks = part
        chunks = slot_chunks(plan, slot)[rank::ranks]
        if not chunks:
            raise ConfigError(
                f"slot {slot} has fewer chunks than the learner's {ranks} ranks; lower data.chunk_tokens"
            )
        return chunks

    if "mixture" not in doc:
        return StreamLoader(_store_of(doc), doc["manifest"], share(doc["plan"]), **shape)
    parts = doc["mixture"]
    loaders = [StreamLoader(_store_of(p), p["manifest"], share(p["plan"]), **shape) for p in parts]
    return MixtureLoader(loaders, [p["name"] for p in parts], [p["weight"] for p in parts], seed=seed)


def _store_of(doc: dict[str, Any]) -> Store:
    store = corpus_store(doc["source"])
    if store is None:
        raise ConfigError(
            f"the run's token corpus {doc['source']} has no .npy files any more; restore it (the run reads "
            "it in place) or prepare a new run"
        )
    return store


def first_tokens(doc: dict[str, Any], slot: int, max_tokens: int) -> torch.Tensor:
    """The first `max_tokens` tokens of slot `slot` in plan order (of a mixture's first source), as int64:
    e.g. SFT's replay windows."""
    doc = doc["mixture"][0] if "mixture" in doc else doc
    store, files = _store_of(doc), files_of(doc["manifest"])  # the planned files: no header read again
    parts, n = [], 0
    for f, s, count in slot_chunks(doc["plan"], slot):
        take = min(count, max_tokens - n)
        parts.append(read_tokens(store, files[f], s, take).astype(np.int64))
        n += take
        if n >= max_tokens:
            break
    return torch.from_numpy(np.concatenate(parts))
