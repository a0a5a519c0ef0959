"""The `data` section of the run config: where the corpus comes from, how it is tokenized and cut.

Design choices:
- `source` names one corpus: the built-in synthetic one, text (tokenized by prepare) or a pre-tokenized
  corpus read in place (`ddiloco.data.streamed`). `sources` names a mixture of pre-tokenized corpora with
  weights instead (e.g. 70% text, 30% code): each learner draws every batch from one of them, at random
  with those weights, deterministically by its seed (`ddiloco.data.tokens.mixture`); the summary reports what
  each learner read of each.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ddiloco.errors import require


@dataclass(kw_only=True, slots=True)
class DataConfig:
    source: str = "synthetic"
    """`synthetic` (built-in generated corpus, no download), a path: .txt/.md file, directory, or .jsonl, or a
    pre-tokenized corpus read in place: a directory, `file://` or `s3://` prefix of `.npy` token files."""
    tokenizer: str = "auto"
    """`byte` (256 bytes + specials), `bpe` (byte-level BPE trained locally on the corpus), `model` (the
    `model.hf` directory's own tokenizer), `auto`: `model` when that directory has tokenizer files, else
    `byte`; or a path: a tokenizer.json (ddiloco's own or a `tokenizers` one) or a directory of tokenizer
    files, e.g. the one `ddiloco tokenize` stored beside a pre-tokenized corpus."""
    vocab_size: int | None = None
    """BPE vocabulary size (only with tokenizer=bpe)."""
    jsonl_field: str = "text"
    """Field holding the text in JSONL inputs."""
    synthetic_docs: int = 60000
    """Number of documents the synthetic generator writes."""
    synthetic_entities: int = 64
    """Entities in the synthetic world (facts to memorise)."""
    val_fraction: float = 0.02
    """Fraction of tokens held out (from the end) for validation."""
    chunk_tokens: int = 1 << 20
    """Pre-tokenized corpora (`ddiloco.data.streamed`): tokens per range a learner reads at once, the unit the
    validation split and the learners' shares are cut in."""
    sources: list[dict[str, Any]] = field(default_factory=list)
    """A mixture of pre-tokenized corpora instead of `source`: [{source: URL_OR_DIR, weight: 0.7, name: text},
    ...] (name: defaults to the source's last path segment); each batch comes from one of them, drawn with
    the weights (normalised), per learner by its seed."""
    num_shards: int | None = None
    """Disjoint training shards; null: one per learner id the run may have (diloco.max_learners). Learner i
    reads shard i; an id ≥ num_shards shares shard i mod num_shards, with a warning (`ddiloco.data.shards`)."""

    def validate(self) -> None:
        if self.tokenizer not in ("auto", "byte", "bpe", "model"):
            require(
                "/" in self.tokenizer or self.tokenizer.endswith(".json"),
                f"data.tokenizer={self.tokenizer!r}: choose one of auto, byte, bpe, model, or give a path to a "
                "tokenizer.json or a directory of tokenizer files",
            )
        if self.tokenizer == "bpe":
            require(
                self.vocab_size is not None and self.vocab_size >= 300,
                "data.tokenizer=bpe needs data.vocab_size ≥ 300",
            )
        else:
            require(
                self.vocab_size is None,
                "data.vocab_size only applies to data.tokenizer=bpe; remove it or set data.tokenizer=bpe",
            )
        require(0 < self.val_fraction < 0.5, "data.val_fraction must be in (0, 0.5)")
        require(self.num_shards is None or self.num_shards >= 1, "data.num_shards must be ≥ 1")
        require(self.chunk_tokens >= 2, "data.chunk_tokens must be ≥ 2")
        self._validate_sources()
        require(
            self.synthetic_docs >= 100 and self.synthetic_entities >= 4,
            "data.synthetic_docs ≥ 100 and data.synthetic_entities ≥ 4",
        )

    def _validate_sources(self) -> None:
        if not self.sources:
            return
        require(
            self.source == "synthetic",
            "data.sources (a mixture) replaces data.source: leave data.source unset",
        )
        for i, s in enumerate(self.sources):
            ok = (
                isinstance(s, dict)
                and isinstance(s.get("source"), str)
                and set(s) <= {"source", "weight", "name"}
            )
            require(ok, f"data.sources[{i}] must be {{source: URL_OR_DIR, weight: W, name: N}}, got {s!r}")
            w = s.get("weight", 1.0)
            require(
                isinstance(w, int | float) and not isinstance(w, bool) and math.isfinite(w) and w > 0,
                f"data.sources[{i}].weight must be a positive number, got {w!r}",
            )
        names = [mixture_name(s) for s in self.sources]
        require(len(set(names)) == len(names), f"data.sources names must differ, got {names}; set name:")


def mixture_name(entry: dict[str, Any]) -> str:
    """A mixture entry's name: `name`, else the last path segment of its source."""
    return str(entry.get("name") or entry["source"].rstrip("/").rsplit("/", 1)[-1])
