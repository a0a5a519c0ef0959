"""One round's life as pure decisions: when it has a quorum, how long it waits for more, when it closes.

No store, no torch, no clock of its own: every function is given the answers present, the time and the
config, so the rules are unit-tested without a run. A round merges once K answers arrived and the adaptive
grace window has passed, or as soon as every live learner answered; it is abandoned when it has no quorum
`round_timeout_s` after it opened. The grace window, fixed when the quorum is reached, is
max(γ·(τ·ξ_step + min(ξ_link, cap) − ξ_quorum − ξ_sync), 0): a late learner is waited for at most τ steps of
compute (the paper's share τ/H), plus what its answers spend in transport (ξ_link, capped by `cap`).

Design notes (why each term, what it kept merged behind slow links): docs/internals.md, "A round's
decisions".
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Iterable, Set
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ddiloco.protocol.messages import OpenRound

if TYPE_CHECKING:  # annotations only: this module runs without torch
    import torch

    from ddiloco.codec.encoded import EncodedTensor
    from ddiloco.config.run import DilocoConfig
    from ddiloco.protocol.update import UpdateHeader
    from ddiloco.syncer.merge.accumulate import RoundSums

DEFAULT_EMA = 0.2
"""Smoothing of ξ_quorum and ξ_sync when the config has no grace section."""
DEFAULT_STEP_S = 0.05
"""ξ_step until a live learner reported its cadence."""


@dataclass(slots=True)
class Answer:
    contributor: str
    header: UpdateHeader
    delta: dict[str, torch.Tensor] | None
    """fp32, relative to the learner's base version (answers built in memory); None once added to its
    round's sums."""
    encoded: dict[str, EncodedTensor] | None = None
    """The same as uploaded and checked (`ddiloco.codec.encoded`), as the intake files it; None once added."""
    key: str = ""
    """The store key it was read from (to read it again)."""
    digest: str = ""
    """SHA-256 of the bytes that were accepted (a second read must find the same)."""
    arrived_s: float | None = None
    """Seconds after its round opened that this syncer filed it (its own clock); None if not recorded."""

    @property
    def wait_s(self) -> float:
        """The learner's own share of the answer's delay (header `wait_s`, its clock; 0 if absent)."""
        return self.header.wait_s


@dataclass(slots=True)
class Round:
    """An open round: its timings (this syncer's clock, `opened_wall` on the wall clock for documents) and
    what the intake collected for it so far."""

    round: int
    fragment_id: int
    opened_at: float
    opened_wall: float
    quorum_at: float | None = None
    grace_s: float = 0.0
    seen: set[str] = field(default_factory=set)
    answers: dict[str, Answer] = field(default_factory=dict)
    sums: RoundSums | None = None
    """The running sums of the answers accepted so far (`ddiloco.syncer.merge.accumulate`); None before the first."""
    rejected: dict[str, str] = field(default_factory=dict)
    retry: dict[str, tuple[float, str]] = field(default_factory=dict)
    """Rejected names: (when to look again, digest of the rejected bytes)."""


def open_rounds(rounds: Iterable[Round]) -> list[OpenRound]:
    """The open rounds as the status and the syncer's state record them (round, fragment, opened)."""
    return [OpenRound(r.round, r.fragment_id, r.opened_wall) for r in rounds]


@dataclass(frozen=True, slots=True)
class OpenRule:
    """When the next round may open: at most τ in flight, never two for one fragment, one per (H/P)·ξ_step,
    and a fragment's round no sooner than H·ξ_step after its previous round opened (`sync_from="open"`, the
    paper's schedule: a fragment synced every H steps, the round's overlap inside them) or, with
    `sync_from="publish"`, after its newest version was published (learners still train on it). No round
    opens until a live learner reported its cadence: a round opened on a guessed ξ_step in a learner's first
    steps (its warm-up) merges one or two steps, closes before the others see it (its grace window is built
    from the warm-up's slow first answer and the guess) and every learner that was stepping loses what it did
    on that fragment when the version arrives; the cadence is known after `chiptime.WARMUP_SAMPLES` + 1
    steps, about the stagger (H/P steps) the first fragment would wait anyway."""

    overlap: int
    sync_every: int
    num_fragments: int
    sync_from: str = "open"

    @classmethod
    def of(cls, d: DilocoConfig, num_fragments: int) -> OpenRule:
        return cls(d.overlap, d.sync_every, num_fragments, d.sync_from)

    def may_open(
        self,
        now: float,
        *,
        fragment: int,
        open_fragments: Collection[int],
        last_open: float,
        published_clock: float,
        measured_step: float | None,
        opened_clock: float = float("-inf"),
    ) -> bool:
        """Whether a round of `fragment` may open at `now` (the syncer's clock, like `last_open`,
        `published_clock`, when the fragment's newest version was published, and `opened_clock`, when its
        last round opened: -inf if not by this syncer)."""
        if measured_step is None or len(open_fragments) >= self.overlap or fragment in open_fragments:
            return False
        if now - last_open < (self.sync_every / self.num_fragments) * measured_step:
            return False
        since = opened_clock if self.sync_from == "open" else published_clock
        return now - since >= self.sync_every * measured_step


class Verdict(enum.Enum):
    WAIT = "wait"
    QUORUM = "quorum"
    """K answers are in, just now: fix the grace window and keep collecting."""
    MERGE = "merge"
    ABANDON = "abandon"


@dataclass(frozen=True, slots=True)
class QuorumRule:
    quorum: int
    """K: answers needed before a round may merge."""
    timeout_s: float
    """A round without K answers this long after it opened is abandoned."""

    @classmethod
    def of(cls, d: DilocoConfig) -> QuorumRule:
        return cls(d.quorum, d.round_timeout_s)


def decide(rnd: Round, live: Set[str], now: float, rule: QuorumRule) -> Verdict:
    """What to do with `rnd` at time `now` (the syncer's clock), given the contributor names of the live
    learners. Pure: the caller applies the verdict."""
    if rnd.quorum_at is None:
        if len(rnd.answers) >= rule.quorum:
            return Verdict.QUORUM
        return Verdict.ABANDON if now - rnd.opened_at > rule.timeout_s else Verdict.WAIT
    if now >= rnd.quorum_at + rnd.grace_s or live <= rnd.answers.keys():
        return Verdict.MERGE
    return Verdict.WAIT


@dataclass(frozen=True, slots=True)
class GraceRule:
    gamma: float
    cap_s: float
    """Upper bound of the transport allowance ξ_link (seconds)."""
    overlap: int
    """τ: steps of compute a fast learner may lose to waiting, per sync of a fragment."""

    @classmethod
    def of(cls, d: DilocoConfig) -> GraceRule | None:
        """From the config; None when the grace window is off (`diloco.grace: null`)."""
        if d.grace is None:
            return None
        return cls(d.grace.gamma, d.grace.cap_seconds, d.overlap)


def grace_window(
    rule: GraceRule | None, xi_step: float, xi_quorum: float, xi_sync: float, xi_link: float = 0.0
) -> float:
    """max(γ·(τ·ξ_step + min(ξ_link, cap) − ξ_quorum − ξ_sync), 0) (module docstring); 0 without a rule."""
    if rule is None:
        return 0.0
    raw = rule.gamma * (rule.overlap * xi_step + min(xi_link, rule.cap_s) - xi_quorum - xi_sync)
    return max(raw, 0.0)


def link_time(answers: Collection[Answer]) -> float | None:
    """The round's transport sample for ξ_link: the largest (arrival − learner's own wait) of its answers,
    each at least 0; None without answers (or none that says when it arrived)."""
    times = [max(a.arrived_s - a.wait_s, 0.0) for a in answers if a.arrived_s is not None]
    return max(times) if times else None


def ema(old: float, new: float, alpha: float) -> float:
    """Exponential moving average; the first sample (old == 0) is taken as it is."""
    return new if old == 0.0 else (1 - alpha) * old + alpha * new
