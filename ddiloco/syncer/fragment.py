"""One fragment of the global model as the syncer holds it: Θ_p, its version, its outer momentum, its ledger.

Design choices:
- A merge is two steps. `propose` does the arithmetic on copies (outer gradients Δ_m = Θ_p − θ_m against
  each answer's base version, robust clipping, the merge of `ddiloco.merge`, one outer Nesterov step) and
  returns a `Proposal`; `commit` adopts it once it is persisted. If persisting fails (store outage) the
  round stays open and is merged again later, and the fragment has not moved.
- The fragment keeps the last few versions it published (`KEEP_VERSIONS`) as bases for answers; an older
  base is read through the `read` callable it was given (it verifies signatures), so no store here.
- With bf16 globals the fragment keeps the rounded values learners see, so the next Δ_m is exact.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from ddiloco.config import DilocoConfig
from ddiloco.globalmodel import Layout
from ddiloco.merge import OuterNesterov, merge_with_stats, token_weight
from ddiloco.protocol import validation
from ddiloco.protocol.messages import Contribution, Ledger, RoundRecord
from ddiloco.syncer.rounds import Answer, Round

KEEP_VERSIONS = 4
KEEP_PUBLISHED = 64
"""Versions whose publish time is kept for the step-clock check of answers."""

Tensors = dict[str, torch.Tensor]


@dataclass(frozen=True, slots=True)
class MergeRule:
    """The outer optimizer's settings (`cfg.diloco`) and the layout's embedding tensors."""

    method: str
    outer_lr: float
    outer_momentum: float
    token_weighting: bool
    robust_clip: float | None
    embedding_names: frozenset[str]

    @classmethod
    def of(cls, d: DilocoConfig, layout: Layout, robust_clip: float | None) -> MergeRule:
        """From the config; `robust_clip` overrides `d.robust_clip` when given."""
        return cls(
            method=d.merge,
            outer_lr=d.outer_lr,
            outer_momentum=d.outer_momentum,
            token_weighting=d.token_weighting,
            robust_clip=robust_clip if robust_clip is not None else d.robust_clip,
            embedding_names=frozenset(layout.embedding_names),
        )

    def optimizer(self) -> OuterNesterov:
        return OuterNesterov(lr=self.outer_lr, momentum=self.outer_momentum)


@dataclass(slots=True)
class Proposal:
    """The outcome of one merge, not yet adopted: the new Θ_p and momentum, and what went into them."""

    version: int
    theta: Tensors
    outer: OuterNesterov
    contributors: dict[str, Contribution]
    clipped: dict[str, float]
    stats: dict[str, float]

    def record(self, rnd: Round, *, now: float, merged_at: float) -> RoundRecord:
        """The round record of this merge of `rnd` (`now`: the syncer's clock when the merge began)."""
        return RoundRecord(
            round=rnd.round,
            fragment_id=rnd.fragment_id,
            version=self.version,
            opened_at=rnd.opened_wall,
            time_to_quorum=(rnd.quorum_at or now) - rnd.opened_at,
            grace_s=rnd.grace_s,
            merged_at=merged_at,
            quorum=len(self.contributors),
            contributors=self.contributors,
            rejected=rnd.rejected,
            merged_norm=self.stats["merged_norm"],
            mean_delta_norm=self.stats["mean_delta_norm"],
            ratio=self.stats["ratio"],
            clipped=self.clipped,
        )


@dataclass(slots=True)
class GlobalFragment:
    """Fragment p of the global model: the newest version this syncer holds and what merging into it needs."""

    fragment_id: int
    version: int
    theta: Tensors
    outer: OuterNesterov
    ledger: Ledger
    read: Callable[[int], Tensors]
    """Reads version v of this fragment from the store (a base older than the ones kept)."""
    recent: dict[int, Tensors] = field(default_factory=dict)
    published_at: dict[int, float] = field(default_factory=dict)
    """version -> wall time just before it was written (no learner can hold it earlier)."""
    merged_clock: float = -math.inf
    """The syncer's clock when this syncer published the current version (round pacing)."""

    def __post_init__(self) -> None:
        self.recent[self.version] = _clone(self.theta)

    def base(self, version: int) -> Tensors:
        """Θ_p at `version`, the base an answer's delta is relative to (PayloadError/NotFound from `read`)."""
        if version not in self.recent:
            self.recent[version] = self.read(version)
        return self.recent[version]

    def propose(self, answers: Mapping[str, Answer], rule: MergeRule) -> Proposal:
        """Merge the answers (by contributor) into the next version, on copies."""
        outer_grads, weights, contributors = [], [], {}
        for c, ans in sorted(answers.items()):
            h = ans.header
            base = self.base(h["base_version"])
            # Δ_m = Θ_p − θ_m with the learner's θ_m = its base + its delta
            outer_grads.append({n: self.theta[n] - base[n] - ans.delta[n] for n in self.theta})
            w = token_weight(h["c_tokens"], h["c_steps"]) if rule.token_weighting else 1.0
            weights.append(w)
            staleness = self.version - h["base_version"]
            contributors[c] = Contribution(
                h["c_tokens"], h["c_steps"], h["c_seconds"], h["base_version"], staleness, w
            )
        clipped: dict[str, float] = {}
        if rule.robust_clip is not None:
            outer_grads, scales = validation.clip_outliers(outer_grads, rule.robust_clip)
            names = sorted(answers)
            clipped = {names[i]: f for i, f in scales.items()}
        merged, stats = merge_with_stats(
            outer_grads, weights, embedding_names=rule.embedding_names, method=rule.method
        )
        outer = rule.optimizer()
        outer.load_state_dict({n: t.clone() for n, t in self.outer.state_dict().items()})
        theta = _clone(self.theta)
        outer.step(theta, merged)
        return Proposal(self.version + 1, theta, outer, contributors, clipped, stats)

    def commit(self, proposal: Proposal, *, published_at: float, clock: float, dtype: str) -> None:
        """Adopt a persisted proposal. `published_at`: wall time before it was written; `clock`: now."""
        theta = proposal.theta
        if dtype == "bf16":  # learners see the rounded values; keep the syncer's copy identical
            for t in theta.values():
                t.copy_(t.to(torch.bfloat16).float())
        self.theta, self.outer, self.version = theta, proposal.outer, proposal.version
        self.published_at[self.version] = published_at
        self.published_at.pop(self.version - KEEP_PUBLISHED, None)
        self.merged_clock = clock
        self.recent[self.version] = _clone(theta)
        for v in sorted(self.recent)[:-KEEP_VERSIONS]:
            del self.recent[v]


def _clone(tensors: Mapping[str, torch.Tensor]) -> Tensors:
    return {n: t.clone() for n, t in tensors.items()}
