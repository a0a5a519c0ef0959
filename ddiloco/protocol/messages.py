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


def credited(merge: Merged | RoundRecord | None, learner_id: int, incarnation: int) -> bool:
    """Whether the merge record `merge` (of one fragment in one round: a status's `Merged` or the round
    record; None when that fragment was not merged in that round) credits learner `learner_id`'s
    `incarnation`."""
    return merge is not None and keys.contributor(learner_id, incarnation) in merge.contributors


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
        return Fields(obj, doc).build(cls)


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
        return Fields(obj, doc).build(cls)


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
    step: str = "outer"
    """`outer`: Θ_p moved by the outer Nesterov step; `mean`: the fragment's last merge while the run closed,
    Θ_p − Δ, the learners' weighted mean (`diloco.closing_step`, `ddiloco.syncer.drain`)."""

    def to_json(self) -> dict[str, Any]:
        return plain(self)

    @classmethod
    def from_json(cls, obj: Any, doc: str = "round record") -> RoundRecord:
        f = Fields(obj, doc)
        contributors = f.mapping("contributors", Mapping)
        return f.build(
            cls,
            contributors={
                c: Contribution.from_json(x, f"{doc}.contributors.{c}") for c, x in contributors.items()
            },
            rejected=f.mapping("rejected", str),
            clipped=f.mapping("clipped", (int, float)),
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
        return f.build(cls, contributors=f.mapping("contributors", int))


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
        return Fields(obj, doc).build(cls)


@dataclass(slots=True)
class LearnerEvent:
    """A learner incarnation (`learner`: its contributor name) joined or was lost (state `learner_events`)."""

    event: str
    learner: str
    time: float

    @classmethod
    def from_json(cls, obj: Any, doc: str = "learner event") -> LearnerEvent:
        return Fields(obj, doc).build(cls)


@dataclass(slots=True)
class Standby:
    """A syncer standing by for the lease (status `standbys`): where it runs and when it last said so."""

    host: str
    pid: int
    time: float

    @classmethod
    def from_json(cls, obj: Any, doc: str = "standby") -> Standby:
        return Fields(obj, doc).build(cls)


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
    closing: bool = False
    """The run's budget is reached: learners stop stepping and answer the last rounds
    (`ddiloco.syncer.drain`)."""
    tokens_per_s: float | None = None
    """Processed tokens per second of the live learners together (their reports; `Roster.throughput`)."""
    mfu: float | None = None
    """The live learners' model FLOP/s over their peak FLOP/s (those that know their peak); None: unknown."""

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
        return f.build(
            cls,
            versions=[versions[str(p)] for p in range(len(versions))],
            open_rounds=f.each("open_rounds", OpenRound.parser("opened_at")),
            merged=f.each("merged", Merged.from_json),
            rejected=f.mapping("rejected", int),
            clipped=f.mapping("clipped", int),
            rejections=f.each("rejections", Rejection.from_json),
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
    credited_steps: dict[str, int] = field(default_factory=dict)
    """"<contributor>/<fragment>" -> the inner step its last merged answer ended at (`claims.Coverage`)."""

    def to_json(self) -> dict[str, Any]:
        return plain(self) | {"open_rounds": [r.to_json("opened_wall") for r in self.open_rounds]}

    @classmethod
    def from_json(cls, obj: Any) -> SyncerState:
        f = Fields(obj, "syncer state")
        versions = f.get("versions", list)
        if any(not isinstance(v, int) or isinstance(v, bool) for v in versions):
            raise f.bad("versions", "is not a list of integers")
        return f.build(
            cls,
            versions=versions,
            ledger=f.each("ledger", Ledger.from_json),
            rejected=f.mapping("rejected", int),
            clipped=f.mapping("clipped", int, {}),
            merged_recent=f.each("merged_recent", Merged.from_json),
            open_rounds=f.each("open_rounds", OpenRound.parser("opened_wall"), []),
            learner_events=f.each("learner_events", LearnerEvent.from_json, []),
            quarantined=f.mapping("quarantined", int, {}),
            credited_steps=f.mapping("credited_steps", int, {}),
        )


# --- done.json: the syncer's end-of-run marker ---------------------------------------------------------------
@dataclass(slots=True)
class ClosingFigures:
    """What the done marker says about the run's closing rounds (`ddiloco.syncer.drain`)."""

    closing_rounds: int
    closing_rounds_merged: int
    closing_seconds: float
    closing_tokens_merged: float

    def to_json(self) -> dict[str, Any]:
        return plain(self)

    @classmethod
    def from_json(cls, obj: Any, doc: str = "closing") -> ClosingFigures:
        return Fields(obj, doc).build(cls)


@dataclass(slots=True)
class Done:
    """done.json: the syncer finished the run (signed by it: `RunRoot.done`). `reason`: `budget` or `deadline`
    (`ddiloco.syncer.loop.finished_by`); `closing`: written beside the other fields when the run closed through
    its closing rounds."""

    time: float
    tokens_merged: float
    reason: str = "budget"
    """Markers from before the field: `budget`, the only reason then."""
    rounds_merged: int | None = None
    """None in markers from before the field."""
    closing: ClosingFigures | None = None

    def to_json(self) -> dict[str, Any]:
        head = {k: v for k, v in plain(self).items() if k != "closing"}
        return head | ({} if self.closing is None else self.closing.to_json())

    @classmethod
    def from_json(cls, obj: Any) -> Done:
        f = Fields(obj, "done")
        closing = ClosingFigures.from_json(obj, "done") if "closing_rounds" in f.obj else None
        return f.build(cls, closing=closing)
