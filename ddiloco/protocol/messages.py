"""The JSON documents of a run root and their schemas: one place per message.

The credit rule lives here too, once: a learner's answer for fragment p in round r counts as merged exactly
when the merge record of (p, r) (the syncer's status or the round record) names its contributor
(`keys.contributor(learner_id, incarnation)`). The learner's token ledger and the run summary both call it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ddiloco import keys
from ddiloco.protocol.fields import Fields, plain


def credited(merge: Mapping[str, Any] | None, learner_id: int, incarnation: int) -> bool:
    """Whether the merge record `merge` ({"contributors": [...], ...} of one fragment in one round, or
    None when that fragment was not merged in that round) credits learner `learner_id`'s `incarnation`."""
    return merge is not None and keys.contributor(learner_id, incarnation) in merge["contributors"]


# --- the syncer's documents: syncer/status.json, syncer/rounds/<round>.json, syncer/state.json ---------------
# Field order is the JSON's order, as learners, the summary, chaos and the report read it. `from_json` raises
# ValueError naming the document and the field that is missing or of the wrong type (`ddiloco.protocol.fields`).
# `epoch`: the syncer lease epoch of the writer (`ddiloco.syncer.lease`); 0 in documents from before the lease.


@dataclass(slots=True)
class Ledger:
    """One fragment's merged work (state `ledger`, one per fragment)."""

    merged_tokens: int = 0
    merged_answers: int = 0
    merged_steps: int = 0

    def to_json(self) -> dict[str, Any]:
        return plain(self)

    @classmethod
    def from_json(cls, obj: Any, doc: str = "ledger") -> Ledger:
        f = Fields(obj, doc)
        return cls(f.integer("merged_tokens"), f.integer("merged_answers"), f.integer("merged_steps"))


@dataclass(slots=True)
class Contribution:
    """One merged answer in a round record (`contributors`, by contributor name)."""

    c_tokens: int
    c_steps: int
    c_seconds: float
    base_version: int
    staleness: int
    weight: float
    """The token weight c_tokens²/c_steps (1.0 without token weighting)."""
    discount: float = 1.0
    """The staleness discount (1 + staleness)^-a its weight was multiplied by (records before it: 1.0)."""

    @classmethod
    def from_json(cls, obj: Any, doc: str = "contribution") -> Contribution:
        f = Fields(obj, doc)
        counts = (f.integer("c_tokens"), f.integer("c_steps"), f.number("c_seconds"))
        return cls(
            *counts,
            f.integer("base_version"),
            f.integer("staleness"),
            f.number("weight"),
            f.get("discount", (int, float), 1.0),
        )


@dataclass(slots=True)
class RoundRecord:
    """syncer/rounds/<round>.json: one merged round. `rejected`: update name -> reason for this round's
    rejected objects; `clipped`: contributor -> the factor robust mode scaled its outer gradient by."""

    round: int
    fragment_id: int
    version: int
    opened_at: float
    time_to_quorum: float
    grace_s: float
    merged_at: float
    quorum: int
    contributors: dict[str, Contribution]
    rejected: dict[str, str]
    merged_norm: float
    mean_delta_norm: float
    ratio: float
    clipped: dict[str, float]
    epoch: int = 0

    def to_json(self) -> dict[str, Any]:
        return plain(self)

    @classmethod
    def from_json(cls, obj: Any, doc: str = "round record") -> RoundRecord:
        f = Fields(obj, doc)
        contributors = f.mapping("contributors", Mapping)
        return cls(
            round=f.integer("round"),
            fragment_id=f.integer("fragment_id"),
            version=f.integer("version"),
            opened_at=f.number("opened_at"),
            time_to_quorum=f.number("time_to_quorum"),
            grace_s=f.number("grace_s"),
            merged_at=f.number("merged_at"),
            quorum=f.integer("quorum"),
            contributors={
                c: Contribution.from_json(x, f"{doc}.contributors.{c}") for c, x in contributors.items()
            },
            rejected=f.mapping("rejected", str),
            merged_norm=f.number("merged_norm"),
            mean_delta_norm=f.number("mean_delta_norm"),
            ratio=f.number("ratio"),
            clipped=f.mapping("clipped", (int, float)),
            epoch=f.get("epoch", int, 0),
        )


@dataclass(slots=True)
class Merged:
    """One recent merge as the status (`merged`) and the state (`merged_recent`) list it, the record
    `credited` reads; `contributors`: contributor name -> c_tokens."""

    round: int
    fragment_id: int
    version: int
    contributors: dict[str, int]

    @classmethod
    def of(cls, record: RoundRecord) -> Merged:
        tokens = {c: x.c_tokens for c, x in record.contributors.items()}
        return cls(record.round, record.fragment_id, record.version, tokens)

    @classmethod
    def from_json(cls, obj: Any, doc: str = "merged") -> Merged:
        f = Fields(obj, doc)
        ids = (f.integer("round"), f.integer("fragment_id"), f.integer("version"))
        return cls(*ids, f.mapping("contributors", int))


@dataclass(slots=True)
class OpenRound:
    """A round still collecting answers. Its wall-clock opening time is `opened_at` in the status and
    `opened_wall` in the state (both are read as they are)."""

    round: int
    fragment_id: int
    opened_wall: float

    def to_json(self, time_field: str) -> dict[str, Any]:
        return {"round": self.round, "fragment_id": self.fragment_id, time_field: self.opened_wall}

    @classmethod
    def parser(cls, time_field: str) -> Callable[[Any, str], OpenRound]:
        def parse(obj: Any, doc: str) -> OpenRound:
            f = Fields(obj, doc)
            return cls(f.integer("round"), f.integer("fragment_id"), f.number(time_field))

        return parse


@dataclass(slots=True)
class Rejection:
    """A rejected update, told to the learner incarnation that authentically sent it (status `rejections`)."""

    learner_id: int
    incarnation: int
    fragment_id: int
    round: int
    reason: str
    time: float

    @classmethod
    def from_json(cls, obj: Any, doc: str = "rejection") -> Rejection:
        f = Fields(obj, doc)
        ids = (
            f.integer("learner_id"),
            f.integer("incarnation"),
            f.integer("fragment_id"),
            f.integer("round"),
        )
        return cls(*ids, f.get("reason", str), f.number("time"))


@dataclass(slots=True)
class LearnerEvent:
    """A learner incarnation (`learner`: its contributor name) joined or was lost (state `learner_events`)."""

    event: str
    learner: str
    time: float

    @classmethod
    def from_json(cls, obj: Any, doc: str = "learner event") -> LearnerEvent:
        f = Fields(obj, doc)
        return cls(f.get("event", str), f.get("learner", str), f.number("time"))


@dataclass(slots=True)
class Standby:
    """A syncer standing by for the lease (status `standbys`): where it runs and when it last said so."""

    host: str
    pid: int
    time: float

    @classmethod
    def from_json(cls, obj: Any, doc: str = "standby") -> Standby:
        f = Fields(obj, doc)
        return cls(f.get("host", str), f.integer("pid"), f.number("time"))


@dataclass(slots=True)
class Status:
    """syncer/status.json: what learners poll (versions, merges, rejections) and chaos reads (host, pid).
    `versions` is per fragment, written {"<fragment>": version}; `loss` the live learners' mean loss EMA
    (NaN when none reported one)."""

    run_id: str
    time: float
    syncer_incarnation: int
    done: bool
    syncer_host: str
    syncer_pid: int
    next_round: int
    versions: list[int]
    open_rounds: list[OpenRound]
    merged: list[Merged]
    tokens_merged: float
    token_budget: float
    rounds_merged: int
    live_learners: int
    loss: float
    rejected: dict[str, int]
    clipped: dict[str, int]
    rejections: list[Rejection]
    epoch: int = 0
    standbys: list[Standby] = field(default_factory=list)
    """Syncers standing by for the lease (`ddiloco.syncer.lease`), as the holder last listed them."""

    def to_json(self) -> dict[str, Any]:
        return plain(self) | {
            "versions": {str(p): v for p, v in enumerate(self.versions)},
            "open_rounds": [r.to_json("opened_at") for r in self.open_rounds],
        }

    @classmethod
    def from_json(cls, obj: Any) -> Status:
        f = Fields(obj, "status")
        versions = f.mapping("versions", int)
        if set(versions) != {str(p) for p in range(len(versions))}:
            raise f.bad("versions", "is not keyed by the fragments 0..P-1")
        return cls(
            run_id=f.get("run_id", str),
            time=f.number("time"),
            syncer_incarnation=f.integer("syncer_incarnation"),
            done=f.get("done", bool),
            syncer_host=f.get("syncer_host", str),
            syncer_pid=f.integer("syncer_pid"),
            next_round=f.integer("next_round"),
            versions=[versions[str(p)] for p in range(len(versions))],
            open_rounds=f.each("open_rounds", OpenRound.parser("opened_at")),
            merged=f.each("merged", Merged.from_json),
            tokens_merged=f.number("tokens_merged"),
            token_budget=f.number("token_budget"),
            rounds_merged=f.integer("rounds_merged"),
            live_learners=f.integer("live_learners"),
            loss=f.number("loss"),
            rejected=f.mapping("rejected", int),
            clipped=f.mapping("clipped", int),
            rejections=f.each("rejections", Rejection.from_json),
            epoch=f.get("epoch", int, 0),
            standbys=f.each("standbys", Standby.from_json, []),
        )


@dataclass(slots=True)
class SyncerState:
    """syncer/state.json: what a restarted syncer continues from; fields older syncers lack read empty."""

    run_id: str
    incarnation: int
    versions: list[int]
    ledger: list[Ledger]
    rejected: dict[str, int]
    clipped: dict[str, int]
    next_round: int
    rounds_merged: int
    rounds_abandoned: int
    merged_recent: list[Merged]
    xi_quorum: float
    xi_sync: float
    started_wall: float
    open_rounds: list[OpenRound]
    bytes_published: int
    late_answers: int
    learner_events: list[LearnerEvent]
    epoch: int = 0
    xi_link: float = 0.0
    quarantined: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return plain(self) | {"open_rounds": [r.to_json("opened_wall") for r in self.open_rounds]}

    @classmethod
    def from_json(cls, obj: Any) -> SyncerState:
        f = Fields(obj, "syncer state")
        versions = f.get("versions", list)
        if any(not isinstance(v, int) or isinstance(v, bool) for v in versions):
            raise f.bad("versions", "is not a list of integers")
        return cls(
            run_id=f.get("run_id", str),
            incarnation=f.integer("incarnation"),
            versions=versions,
            ledger=f.each("ledger", Ledger.from_json),
            rejected=f.mapping("rejected", int),
            clipped=f.mapping("clipped", int, {}),
            next_round=f.integer("next_round"),
            rounds_merged=f.integer("rounds_merged"),
            rounds_abandoned=f.integer("rounds_abandoned"),
            merged_recent=f.each("merged_recent", Merged.from_json),
            xi_quorum=f.number("xi_quorum"),
            xi_sync=f.number("xi_sync"),
            xi_link=f.get("xi_link", (int, float), 0.0),
            started_wall=f.number("started_wall"),
            open_rounds=f.each("open_rounds", OpenRound.parser("opened_wall"), []),
            bytes_published=f.integer("bytes_published"),
            late_answers=f.integer("late_answers"),
            learner_events=f.each("learner_events", LearnerEvent.from_json, []),
            epoch=f.get("epoch", int, 0),
            quarantined=f.mapping("quarantined", int, {}),
        )


# --- written by learners: learners/<id>/report-<incarnation>.json ------------------------------------------
# The report (heartbeat) is plain, unsigned JSON read by the syncer (pacing, liveness, loss), the summary
# (the token books) and chaos. Field order is the JSON's order; `from_json` raises ValueError naming the field.

_OPT_NUM = (int, float, type(None))


@dataclass(frozen=True, slots=True)
class PendingAnswer:
    """A fragment's answer in flight: its round and the counters it carried (c_tokens, c_seconds, c_steps)."""

    round: int
    tokens: int
    seconds: float
    steps: int

    @classmethod
    def from_json(cls, obj: Any, doc: str = "pending") -> PendingAnswer:
        f = Fields(obj, doc)
        return cls(f.integer("round"), f.integer("tokens"), f.number("seconds"), f.integer("steps"))


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

    def to_json(self) -> dict[str, Any]:
        return plain(self)

    @classmethod
    def from_json(cls, obj: Any, doc: str = "fragment") -> FragmentBooks:
        f = Fields(obj, doc)
        pending = f.get("pending", (Mapping, type(None)))
        return cls(
            anchor=f.integer("anchor"),
            c_steps=f.integer("c_steps"),
            c_tokens=f.integer("c_tokens"),
            c_seconds=f.number("c_seconds"),
            merged_tokens=f.integer("merged_tokens"),
            merged_seconds=f.number("merged_seconds"),
            discarded_tokens=f.integer("discarded_tokens"),
            pending=None if pending is None else PendingAnswer.from_json(pending, f"{doc}.pending"),
        )


@dataclass(frozen=True, slots=True)
class DataRead:
    """Which data a learner reads (report `data`, `ddiloco.shards`): shard `shard`, tokens [start, end) of the
    training stream; `own`: false when its id has no shard of its own and shares this one; `epochs`: passes
    its data cursor (kept across incarnations) has made over the shard."""

    shard: int
    start: int
    end: int
    own: bool
    epochs: float

    def to_json(self) -> dict[str, Any]:
        return plain(self)

    @classmethod
    def from_json(cls, obj: Any, doc: str = "data") -> DataRead:
        f = Fields(obj, doc)
        span = (f.integer("shard"), f.integer("start"), f.integer("end"))
        return cls(*span, f.get("own", bool), f.number("epochs"))


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
    """The data it reads (absent in reports from before `ddiloco.shards`)."""

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
        return cls(
            run_id=f.get("run_id", str),
            learner_id=f.integer("learner_id"),
            incarnation=f.integer("incarnation"),
            seq=f.integer("seq"),
            time=f.number("time"),
            started_at=f.number("started_at"),
            joined_at=f.get("joined_at", _OPT_NUM),
            inner_step=f.integer("inner_step"),
            host=f.get("host", str),
            pid=f.integer("pid"),
            site=f.get("site", str),
            tokens_processed=f.integer("tokens_processed"),
            busy_seconds=f.number("busy_seconds"),
            loss=f.get("loss", _OPT_NUM),
            loss_ema=f.get("loss_ema", _OPT_NUM),
            step_time_ema=f.get("step_time_ema", _OPT_NUM),
            rounds_answered=f.integer("rounds_answered"),
            step_wall_ema=f.get("step_wall_ema", _OPT_NUM),
            productive_seconds=f.number("productive_seconds"),
            bytes_up=f.integer("bytes_up"),
            bytes_down=f.integer("bytes_down"),
            upload_failures=f.integer("upload_failures"),
            final=f.get("final", bool),
            exit_reason=f.get("exit_reason", (str, type(None))),
            fragments={
                p: FragmentBooks.from_json(x, f"learner report.fragments.{p}") for p, x in frags.items()
            },
            rejected_globals=f.mapping("rejected_globals", int),
            rejected_updates=f.mapping("rejected_updates", int),
            history=history,
            lr=f.get("lr", _OPT_NUM),
            progress=f.number("progress"),
            data=None if data is None else DataRead.from_json(data, "learner report.data"),
        )
