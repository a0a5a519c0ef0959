"""Which shard a learner (or a baseline rank) reads, and the run's record of which data each learner read.

`prepare` cuts the training tokens into `num_shards` disjoint contiguous shards, one per learner id the run
may have (`RunConfig.num_shards`), so a learner added mid-run reads tokens no other learner reads. Learner
id i < num_shards reads shard i; a larger id still trains, on shard i mod num_shards, with a warning, its
reports marking the data `own: false` and the summary listing the shard under `shared_shards`: scavenged
compute still helps, and the reuse is never silent. A shard's token range follows from `data/meta.json`'s
`shard_tokens`. The summary's view (`data_read`) is built from the learners' reports alone: per learner
id its shard, epochs and tokens, plus `shared_shards`, `unread_shards` and `data_mixture`.

Design notes: docs/internals.md, "From text files to shards and batches".
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ddiloco.protocol.learner_report import DataRead, LearnerReport

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Assignment:
    """The shard learner (or rank) `who` reads: tokens [start, end) of the training stream; `own`: no other
    id is assigned it."""

    who: int
    shard: int
    start: int
    end: int
    own: bool

    def read(
        self, epochs: float, started: float | None = None, by_source: dict[str, int] | None = None
    ) -> DataRead:
        """The report's `data` once the data cursor has made `epochs` passes over the shard (`started`: where
        this incarnation's reading began; `by_source`: tokens read from each corpus of a mixture)."""
        span = {"shard": self.shard, "start": self.start, "end": self.end, "own": self.own}
        return DataRead(**span, epochs=epochs, started=started, sources=by_source)


def assign_shard(who: int, shard_tokens: Sequence[int], *, role: str = "learner") -> Assignment:
    """Shard of learner id (or baseline rank) `who` on a run prepared with shards of `shard_tokens` tokens;
    warns when the id has no shard of its own (see the module docstring)."""
    if who < 0:
        raise ValueError(f"{role} id {who} must be ≥ 0")
    n = len(shard_tokens)
    if n < 1:
        raise ValueError("the run's data/meta.json lists no shards; rerun `ddiloco prepare`")
    shard = who % n
    start = sum(int(t) for t in shard_tokens[:shard])
    own = who < n
    if not own:
        log.warning(
            "%s %d has no shard of its own: the run was prepared with %d shards (ids 0..%d), so it reads "
            "shard %d, the same tokens as %s %d; prepare runs for more learners with diloco.max_learners "
            "(or start it with an unused id below %d). The summary lists it under shared_shards.",
            role,
            who,
            n,
            n - 1,
            shard,
            role,
            shard,
            n,
        )
    return Assignment(who, shard, start, start + int(shard_tokens[shard]), own)


def data_read(reports: Iterable[LearnerReport], num_shards: int) -> dict[str, Any]:
    """The summary's record of which data each learner id read (see the module docstring)."""
    latest: dict[int, LearnerReport] = {}
    processed: dict[int, int] = {}
    for rep in reports:
        lid = rep.learner_id
        processed[lid] = processed.get(lid, 0) + rep.tokens_processed
        if rep.data is not None and _newer(rep, latest.get(lid)):
            latest[lid] = rep
    per_learner: dict[str, dict[str, Any]] = {}
    readers: dict[int, list[int]] = {}
    for lid in sorted(processed):
        d = latest[lid].data if lid in latest else None
        entry: dict[str, Any] = {"shard": None, "tokens_processed": processed[lid]}
        if d is not None:
            readers.setdefault(d.shard, []).append(lid)
            where = {k: v for k, v in d.to_json().items() if k != "started" and (k != "sources" or v)}
            entry = {**where, "tokens_processed": processed[lid]}
        per_learner[str(lid)] = entry
    mixed: dict[str, int] = {}
    for entry in per_learner.values():
        for name, n in (entry.get("sources") or {}).items():
            mixed[name] = mixed.get(name, 0) + n
    total = sum(mixed.values())
    return {
        "data_shards": num_shards,
        "data_read": per_learner,
        "data_mixture": {n: {"tokens": v, "share": v / total} for n, v in sorted(mixed.items())}
        if total
        else None,
        "shared_shards": {str(s): ids for s, ids in sorted(readers.items()) if len(ids) > 1},
        "unread_shards": [s for s in range(num_shards) if s not in readers],
    }


def _newer(rep: LearnerReport, than: LearnerReport | None) -> bool:
    return than is None or (rep.incarnation, rep.seq) > (than.incarnation, than.seq)
