"""Token ranges of a corpus manifest: fixed-size chunks, a validation hold-out, and disjoint learner slots.

Chunks of `chunk_tokens` (default 1<<20) never cross a file boundary; a chunk is `[file, start, count]`.
Validation is held out first, deterministically and spread over the corpus (every k-th chunk), so it never
changes with the seed or the learner count. The rest is shuffled once by `seed` and dealt round-robin to
`max_learners = num_slots + reserve` slots (slot id = learner id); the reserve slots let a learner added
mid-run read chunks no one else reads without re-cutting anything. Everything is a pure function of the
manifest and the arguments, and the JSON plan's `corpus` fingerprint lets a reader refuse a plan of
another corpus.

Design notes: docs/internals.md, "Pre-tokenized corpora".
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np

from ddiloco.data.tokens.corpus import TokenCorpus, files_of
from ddiloco.data.tokens.npy import CorpusError

__all__ = [
    "DEFAULT_CHUNK_TOKENS",
    "PLAN_FORMAT",
    "corpus_fingerprint",
    "cut_chunks",
    "hold_out",
    "plan_ranges",
    "slot_chunks",
]

DEFAULT_CHUNK_TOKENS = 1 << 20
PLAN_FORMAT = "ddiloco.data.tokens.plan/1"
Chunk = list[int]
"""[file index, first token, token count]"""


def corpus_fingerprint(manifest: dict[str, Any]) -> str:
    """A short hash of the manifest's files (key, dtype, count, digest): the corpus's identity."""
    files = [[f["key"], f["dtype"], f["count"], f.get("digest", "")] for f in manifest["files"]]
    return hashlib.sha256(json.dumps(files).encode()).hexdigest()[:16]


def cut_chunks(
    manifest: dict[str, Any] | TokenCorpus, chunk_tokens: int = DEFAULT_CHUNK_TOKENS
) -> list[Chunk]:
    """Every file cut into chunks of chunk_tokens (a file's last one may be shorter), in corpus order."""
    if chunk_tokens < 2:
        raise ValueError(f"chunk_tokens must be at least 2, got {chunk_tokens}")
    return [
        [i, start, min(chunk_tokens, tf.count - start)]
        for i, tf in enumerate(files_of(manifest))
        for start in range(0, tf.count, chunk_tokens)
    ]


def hold_out(chunks: list[Chunk], val_tokens: int, chunk_tokens: int) -> tuple[list[int], list[int]]:
    """(indices of the validation chunks, indices of the rest), both ascending (rule: module docstring)."""
    if val_tokens < 0:
        raise ValueError(f"val_tokens must be >= 0, got {val_tokens}")
    if val_tokens == 0:
        return [], list(range(len(chunks)))
    n = len(chunks)
    stride = max(1, n // -(-val_tokens // chunk_tokens))
    val, held = [], 0
    for phase in range(stride):
        for i in range(phase, n, stride):
            if held >= val_tokens:
                break
            val.append(i)
            held += chunks[i][2]
    if held < val_tokens or len(val) == n:
        total = sum(c[2] for c in chunks)
        raise CorpusError(
            f"val_tokens={val_tokens} leaves no training tokens of the corpus's {total}; lower the validation "
            f"size or add token files"
        )
    taken = set(val)
    return sorted(val), [i for i in range(n) if i not in taken]


def plan_ranges(
    manifest: dict[str, Any],
    *,
    num_slots: int,
    reserve: int = 0,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    val_tokens: int = 0,
    seed: int = 0,
) -> dict[str, Any]:
    """Cut, hold out validation, and deal the rest to num_slots + reserve learner slots (JSON-able)."""
    if num_slots < 1 or reserve < 0:
        raise ValueError(f"num_slots must be >= 1 and reserve >= 0, got {num_slots} and {reserve}")
    chunks = cut_chunks(manifest, chunk_tokens)
    val_idx, train_idx = hold_out(chunks, val_tokens, chunk_tokens)
    max_learners = num_slots + reserve
    order = np.random.default_rng([seed % 2**64, 0x70C5]).permutation(len(train_idx))
    slots: list[list[Chunk]] = [[] for _ in range(max_learners)]
    for pos, j in enumerate(order):
        slots[pos % max_learners].append(chunks[train_idx[int(j)]])
    empty = [i for i, s in enumerate(slots) if not s]
    if empty:
        raise CorpusError(
            f"{len(train_idx)} training chunks of {chunk_tokens} tokens cannot give each of {max_learners} learner "
            f"slots one (slots {empty} are empty); lower chunk_tokens, the learners or the reserve, or add data"
        )
    return {
        "format": PLAN_FORMAT,
        "corpus": corpus_fingerprint(manifest),
        "chunk_tokens": chunk_tokens,
        "seed": seed,
        "num_slots": num_slots,
        "reserve": reserve,
        "val": [chunks[i] for i in val_idx],
        "val_tokens": sum(chunks[i][2] for i in val_idx),
        "slots": slots,
        "slot_tokens": [sum(c[2] for c in s) for s in slots],
    }


def slot_chunks(plan: dict[str, Any], learner_id: int) -> list[Chunk]:
    """The chunks learner `learner_id` reads; CorpusError if the plan has no slot for it."""
    if plan.get("format") != PLAN_FORMAT:
        raise CorpusError(
            f"not a token range plan (format {PLAN_FORMAT!r} expected); build it with plan_ranges()"
        )
    slots = plan["slots"]
    if not 0 <= learner_id < len(slots):
        raise CorpusError(
            f"learner id {learner_id} has no token ranges: the plan has {len(slots)} slots "
            f"(num_slots {plan['num_slots']} + reserve {plan['reserve']}); plan with a larger reserve"
        )
    return [list(c) for c in slots[learner_id]]
