"""The learner's report (heartbeat): learners/<id>/report-<incarnation>.json and the records inside it.

The report is plain, unsigned JSON read by the syncer (pacing, liveness, loss), the summary (the token books)
and chaos. Field order is the JSON's order; `from_json` raises ValueError naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from ddiloco.protocol.fields import Fields, plain


@dataclass(frozen=True, slots=True)
class PendingAnswer:
    """A fragment's answer in flight: its round and the counters it carried (c_tokens, c_seconds, c_steps)."""

    round: int
    tokens: int
    seconds: float
    steps: int

    @classmethod
    def from_json(cls, obj: Any, doc: str = "pending") -> PendingAnswer:
        return Fields(obj, doc).build(cls)


@dataclass(slots=True)
class FragmentBooks:
    """One fragment's token books in a learner incarnation (report `fragments`, by fragment): counters since
    the anchor (the global version last received), what was merged and discarded, the answer in flight.
    `ddiloco.learner.ledger.FragmentLedger` keeps one per fragment."""

    anchor: int = 0
    c_steps: int = 0
    c_tokens: int = 0
    c_seconds: float = 0.0
    merged_tokens: int = 0
    merged_seconds: float = 0.0
    discarded_tokens: int = 0
    pending: PendingAnswer | None = None

    def settled(self, credited: bool, *, final: bool) -> FragmentBooks:
        """These books with the answer in flight settled: its tokens and seconds merged when `credited`
        (`ddiloco.protocol.messages.credited`). The rest since the anchor is discarded when `final` (a version
        overwrote it, or the incarnation trains no more) and the counters restart; else it stays outstanding
        (the credited answer's counters leave `c_*`). The learner's ledger and the run summary both settle so."""
        pend = self.pending if credited else None
        tokens, seconds, steps = (0, 0.0, 0) if pend is None else (pend.tokens, pend.seconds, pend.steps)
        merged = replace(
            self,
            merged_tokens=self.merged_tokens + tokens,
            merged_seconds=self.merged_seconds + seconds,
            pending=None,
        )
        if final:
            rest = self.c_tokens - tokens
            return replace(
                merged, discarded_tokens=self.discarded_tokens + rest, c_steps=0, c_tokens=0, c_seconds=0.0
            )
        return replace(
            merged,
            c_steps=self.c_steps - steps,
            c_tokens=self.c_tokens - tokens,
            c_seconds=self.c_seconds - seconds,
        )

    def to_json(self) -> dict[str, Any]:
        return plain(self)

    @classmethod
    def from_json(cls, obj: Any, doc: str = "fragment") -> FragmentBooks:
        f = Fields(obj, doc)
        pending = f.get("pending", (Mapping, type(None)))
        return f.build(  # every counter is required in a report, whatever the dataclass defaults
            cls,
            defaults=False,
            pending=None if pending is None else PendingAnswer.from_json(pending, f"{doc}.pending"),
        )


@dataclass(frozen=True, slots=True)
class DataRead:
    """Which data a learner reads (report `data`, `ddiloco.data.shards`): shard `shard`, tokens [start, end) of the
    training stream; `own`: false when its id has no shard of its own and shares this one; `epochs`: passes
    its data cursor (kept across incarnations) has made over the shard; `started`: the passes it had made
    when this incarnation began reading (None in reports from before the field)."""

    shard: int
    start: int
    end: int
    own: bool
    epochs: float
    started: float | None = None
    sources: dict[str, int] | None = None
    """Tokens read from each corpus of a mixture (`data.sources`), across restarts; None without one."""

    def to_json(self) -> dict[str, Any]:
        return plain(self)

    @classmethod
    def from_json(cls, obj: Any, doc: str = "data") -> DataRead:
        f = Fields(obj, doc)
        sources = f.get("sources", (Mapping, type(None)), None)
        if sources is not None and not all(isinstance(v, int) and v >= 0 for v in sources.values()):
            raise f.bad("sources", "is not a map of token counts")
        return f.build(cls, sources=sources)


@dataclass(slots=True)
class LearnerReport:
    """learners/<id>/report-<incarnation>.json, rewritten by every heartbeat and before every upload (`seq`
    orders them). `history`: [wall time, inner_step, tokens_processed, loss_ema] points, bounded."""

    run_id: str
    learner_id: int
    incarnation: int
    seq: int
    time: float
    started_at: float
    joined_at: float | None
    inner_step: int
    host: str
    pid: int
    site: str
    tokens_processed: int
    busy_seconds: float
    loss: float | None
    loss_ema: float | None
    step_time_ema: float | None
    rounds_answered: int
    step_wall_ema: float | None
    productive_seconds: float
    bytes_up: int
    bytes_down: int
    upload_failures: int
    final: bool
    exit_reason: str | None
    fragments: dict[str, FragmentBooks]
    rejected_globals: dict[str, int]
    rejected_updates: dict[str, int]
    history: list[list[float]]
    lr: float | None
    progress: float
    data: DataRead | None = None
    """The data it reads (absent in reports from before `ddiloco.data.shards`)."""
    peak_rss_bytes: int | None = None
    """The learner process's peak resident memory so far (`ddiloco.platform.procinfo`; rank 0 under DDP)."""
    cursor: dict[str, Any] | None = None
    """The data cursor after the last step this report counts (single-process learners): a restart resumes
    there (`ddiloco.learner.resume`). None under DDP, whose ranks resume from their checkpoint."""
    # Efficiency (`ddiloco.learner.efficiency`); None in reports from before the fields, or where unknown.
    tokens_per_s: float | None = None
    """Processed tokens per second now (all ranks; a step's tokens over the loop's wall seconds per step)."""
    flops_per_token: float | None = None
    """Model FLOPs per trained token (6·N non-embedding + 12·L·C·T attention, forward and backward)."""
    peak_flops: float | None = None
    """Peak FLOP/s of the learner's devices together (one device's × ranks); None: unknown (no MFU)."""
    peak_flops_source: str | None = None
    """Where the peak comes from: a data-sheet entry of `ddiloco.platform.peaks`, `train.peak_flops`, or why unknown."""
    mfu: float | None = None
    """flops_per_token × tokens_per_s / peak_flops; None while either is unknown."""
    device_name: str | None = None
    """The device it trains on (`torch.cuda.get_device_name`, or `cpu`)."""
    data_wait_seconds: float | None = None
    """Seconds this incarnation's steps waited for their next batch (part of `busy_seconds`)."""
    peak_memory_bytes: int | None = None
    """Peak memory of this incarnation, of the kind `peak_memory_kind` says."""
    peak_memory_kind: str | None = None
    """`cuda_max_allocated` (torch.cuda.max_memory_allocated of its device) or `peak_rss` (on CPU)."""

    def to_json(self) -> dict[str, Any]:
        return plain(self)

    @classmethod
    def from_json(cls, obj: Any) -> LearnerReport:
        f = Fields(obj, "learner report")
        frags = f.mapping("fragments", Mapping)
        history = f.get("history", list)
        if any(not isinstance(h, list) for h in history):
            raise f.bad("history", "is not a list of points")
        data = f.get("data", (Mapping, type(None)), None)
        return f.build(
            cls,
            fragments={
                p: FragmentBooks.from_json(x, f"learner report.fragments.{p}") for p, x in frags.items()
            },
            rejected_globals=f.mapping("rejected_globals", int),
            rejected_updates=f.mapping("rejected_updates", int),
            history=history,
            data=None if data is None else DataRead.from_json(data, "learner report.data"),
            cursor=f.get("cursor", (Mapping, type(None)), None),
        )
