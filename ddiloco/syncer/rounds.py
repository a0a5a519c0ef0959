"""One round's life as pure decisions: when it has a quorum, how long it waits for more, when it closes.

Design choices:
- No store, no torch, no clock of its own: every function is given the answers present, the time and the
  config, so the rules are unit-tested without a run (`tests/unit/test_rounds.py`).
- A round merges once K answers arrived and the adaptive grace window has passed, or as soon as every live
  learner answered; it is abandoned when it has no quorum `round_timeout_s` after it opened.
- Reaching the quorum and merging are two separate verdicts, on two passes of the loop: the grace window
  is fixed at the moment of the quorum (from the timings known then) and the merge comes at the earliest
  on the next pass.
- The grace window is clamp(γ·(τ·ξ_round − ξ_quorum − ξ_sync), 0, cap) with ξ_round = (H/P)·ξ_step, the
  time between two rounds: a learner keeps training for τ rounds before it needs the merged result. With
  the paper's H = P this is DESIGN's τ·ξ_step; with H/P steps per round, τ·ξ_step alone would shrink the
  window to nothing as soon as answers take longer than a step to arrive (learners behind slow links).
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Set
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: this module runs without torch
    import torch

    from ddiloco.accumulate import RoundSums
    from ddiloco.config import DilocoConfig

DEFAULT_EMA = 0.2
"""Smoothing of ξ_quorum and ξ_sync when the config has no grace section."""
DEFAULT_STEP_S = 0.05
"""ξ_step until a live learner reported its cadence."""


@dataclass(slots=True)
class Answer:
    contributor: str
    header: dict[str, Any]
    delta: dict[str, torch.Tensor] | None
    """fp32, relative to the learner's base version; None once added to its round's sums."""
    key: str = ""
    """The store key it was read from (to read it again)."""
    digest: str = ""
    """SHA-256 of the bytes that were accepted (a second read must find the same)."""


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
    """The running sums of the answers accepted so far (`ddiloco.accumulate`); None before the first."""
    rejected: dict[str, str] = field(default_factory=dict)
    retry: dict[str, tuple[float, str]] = field(default_factory=dict)
    """Rejected names: (when to look again, digest of the rejected bytes)."""


@dataclass(frozen=True, slots=True)
class OpenRule:
    """When the next round may open: at most τ in flight, never two for one fragment, one per (H/P)·ξ_step,
    and a fragment's round no sooner than H·ξ_step after its newest version was published (learners still
    train on it). Until a learner reported its cadence, only the first three hold, with a guessed ξ_step."""

    overlap: int
    sync_every: int
    num_fragments: int

    @classmethod
    def of(cls, d: DilocoConfig, num_fragments: int) -> OpenRule:
        return cls(d.overlap, d.sync_every, num_fragments)

    def may_open(
        self,
        now: float,
        *,
        fragment: int,
        open_fragments: Collection[int],
        last_open: float,
        published_clock: float,
        measured_step: float | None,
    ) -> bool:
        """Whether a round of `fragment` may open at `now` (the syncer's clock, like `last_open` and
        `published_clock`, when the fragment's newest version was published: -inf if not by this syncer)."""
        if len(open_fragments) >= self.overlap or fragment in open_fragments:
            return False
        xi = measured_step or DEFAULT_STEP_S
        if now - last_open < (self.sync_every / self.num_fragments) * xi:
            return False
        return measured_step is None or now - published_clock >= self.sync_every * xi


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
    overlap: int
    """τ: rounds in flight."""
    steps_per_round: float
    """H/P, at least 1."""

    @classmethod
    def of(cls, d: DilocoConfig, num_fragments: int) -> GraceRule | None:
        """From the config; None when the grace window is off (`diloco.grace: null`)."""
        if d.grace is None:
            return None
        steps = max(d.sync_every / num_fragments, 1.0)
        return cls(d.grace.gamma, d.grace.cap_seconds, d.overlap, steps)


def grace_window(rule: GraceRule | None, xi_step: float, xi_quorum: float, xi_sync: float) -> float:
    """clamp(γ·(τ·ξ_round − ξ_quorum − ξ_sync), 0, cap), ξ_round = (H/P)·ξ_step; 0 without a grace rule."""
    if rule is None:
        return 0.0
    raw = rule.gamma * (rule.overlap * rule.steps_per_round * xi_step - xi_quorum - xi_sync)
    return min(max(raw, 0.0), rule.cap_s)


def ema(old: float, new: float, alpha: float) -> float:
    """Exponential moving average; the first sample (old == 0) is taken as it is."""
    return new if old == 0.0 else (1 - alpha) * old + alpha * new
