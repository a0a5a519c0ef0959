"""One fragment of the global model as the syncer holds it: Θ_p, its version, its outer momentum, its ledger.

A merge is two steps: `propose` finalises the round's running sums (`ddiloco.syncer.merge.accumulate`, with
robust clipping or the trimmed mean) and takes one outer Nesterov step on copies, and `commit` adopts the
`Proposal` once it is persisted; a failed persist leaves the fragment unmoved and the round open. Outer
gradients are taken against each answer's own base (Δ_m = −δ_m), so a stale answer contributes exactly the
progress it made; its weight is discounted by (1 + s)^-a, and the round's step by its freshest answer's
discount. `theta` is the fp32 master, never rounded. Between merges a fragment holds Θ_p and its momentum
only, in pooled buffers (`ddiloco.syncer.merge.bufferpool`); no published version is kept in memory.

Design notes (the staleness rule, the master, memory): docs/internals.md, "A fragment on the syncer".
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from ddiloco.config.run import DilocoConfig, TrainConfig
from ddiloco.protocol.messages import Contribution, Ledger, RoundRecord
from ddiloco.protocol.update import UpdateHeader
from ddiloco.run.globalmodel import Layout
from ddiloco.run.schedule import decay_of, progress_of
from ddiloco.syncer.merge.accumulate import Reread, RoundSums
from ddiloco.syncer.merge.bufferpool import SYNCER_POOL, carve
from ddiloco.syncer.merge.outer import OuterNesterov, staleness_discount, token_weight
from ddiloco.syncer.merge.robust import TRIMMED_MEAN
from ddiloco.syncer.rounds import Answer, Round

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
    staleness_exponent: float = 0.5
    """a of the staleness discount (1 + s)^-a (module docstring); 0 turns it off."""
    schedule: TrainConfig | None = None
    """The learners' training settings whose inner-rate decay the outer momentum follows (`lr_scale`); None
    when `diloco.momentum_follows_lr` is off or no train config was given."""
    token_budget: int = 0
    robust_merge: str | None = None
    """`trimmed_mean`: rounds of 3 or more answers merge as their coordinate-wise trimmed mean
    (`ddiloco.syncer.merge.robust`); None: off."""
    robust_trim: float = 0.2
    """β of the trimmed mean."""

    @property
    def momentum_follows_lr(self) -> bool:
        return self.schedule is not None and self.schedule.lr_schedule != "constant"

    @classmethod
    def of(
        cls, d: DilocoConfig, layout: Layout, robust_clip: float | None, train: TrainConfig | None = None
    ) -> MergeRule:
        """From the config; `robust_clip` overrides `d.robust_clip` when given; `train`: the inner schedule
        the momentum follows (None: a constant scale)."""
        return cls(
            method=d.merge,
            outer_lr=d.outer_lr,
            outer_momentum=d.outer_momentum,
            token_weighting=d.token_weighting,
            robust_clip=robust_clip if robust_clip is not None else d.robust_clip,
            embedding_names=frozenset(layout.embedding_names),
            staleness_exponent=d.staleness_exponent,
            schedule=train if d.momentum_follows_lr else None,
            token_budget=d.token_budget,
            robust_merge=d.robust_merge,
            robust_trim=d.robust_trim,
        )

    def optimizer(self) -> OuterNesterov:
        return OuterNesterov(lr=self.outer_lr, momentum=self.outer_momentum)

    def lr_scale(self, tokens_merged: float) -> float:
        """The learners' inner-rate decay at `tokens_merged` (`ddiloco.run.schedule`, the progress they read);
        1.0 when the momentum does not follow it."""
        if self.schedule is None:
            return 1.0
        return decay_of(progress_of(tokens_merged, self.token_budget), self.schedule)


@dataclass(slots=True)
class Proposal:
    """The outcome of one merge, not yet adopted: the new Θ_p and momentum, and what went into them."""

    version: int
    theta: Tensors
    outer: OuterNesterov
    contributors: dict[str, Contribution]
    clipped: dict[str, float]
    stats: dict[str, float]
    pooled: tuple[torch.Tensor, ...] = ()
    """The pooled buffers `theta` and the momentum are views of (given back when they are replaced)."""
    final: bool = False
    """The fragment's last merge of the run: Θ_p − Δ, no outer rate or look-ahead (`propose`)."""

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
            step="mean" if self.final else "outer",
        )


@dataclass(slots=True)
class GlobalFragment:
    """Fragment p of the global model: the newest version this syncer holds and what merging into it needs."""

    fragment_id: int
    version: int
    theta: Tensors
    """The fp32 master Θ_p (what the outer optimizer steps), never rounded."""
    outer: OuterNesterov
    ledger: Ledger
    read: Callable[[int], Tensors]
    """Reads version v of this fragment from the store as published (verified): what learners hold."""
    published_at: dict[int, float] = field(default_factory=dict)
    """version -> the syncer's steady wall time just before it was written (no learner holds it earlier)."""
    merged_clock: float = -math.inf
    """The syncer's clock when this syncer published the current version (round pacing)."""
    pooled: tuple[torch.Tensor, ...] = ()
    """The pooled buffers `theta` and the momentum are views of (none when they were read from the store)."""

    def base(self, version: int) -> Tensors:
        """Θ_p as published at `version`: what learners hold, read from the store (PayloadError/NotFound from
        `read`). Nothing of it is kept in memory (module docstring)."""
        return self.read(version)

    def weigh(self, header: UpdateHeader, rule: MergeRule) -> tuple[float, float]:
        """(token weight, staleness discount) of an answer merged into the current version."""
        w = token_weight(header.c_tokens, header.c_steps) if rule.token_weighting else 1.0
        return w, staleness_discount(self.version - header.base_version, rule.staleness_exponent)

    def new_sums(self, rule: MergeRule) -> RoundSums:
        """Empty running sums for a round of this fragment (`ddiloco.syncer.merge.accumulate`)."""
        shapes = {n: t.shape for n, t in self.theta.items()}
        trim = rule.robust_trim if rule.robust_merge == TRIMMED_MEAN else None
        return RoundSums(
            shapes, method=rule.method, embedding_names=rule.embedding_names, pool=SYNCER_POOL, trim=trim
        )

    def add_answer(self, sums: RoundSums, ans: Answer, rule: MergeRule) -> None:
        """Add an answer's δ to a round's sums with its merge weight (token weight × discount). A round is
        open on one version of its fragment, so the weight is the one the merge would give it."""
        w, discount = self.weigh(ans.header, rule)
        if ans.encoded is not None:
            sums.add_encoded(ans.contributor, w * discount, ans.encoded, ans.header.norms)
        elif ans.delta is not None:
            sums.add(ans.contributor, w * discount, {n: ans.delta[n] for n in self.theta})
        else:
            raise ValueError(f"answer of {ans.contributor} has no delta to add")

    def accept(self, rnd: Round, ans: Answer, rule: MergeRule) -> None:
        """Add a valid answer of `rnd` to the round's running sums and drop its δ."""
        if rnd.sums is None:
            rnd.sums = self.new_sums(rule)
        self.add_answer(rnd.sums, ans, rule)
        ans.delta = ans.encoded = None

    def propose(
        self,
        answers: Mapping[str, Answer],
        rule: MergeRule,
        sums: RoundSums | None = None,
        reread: Reread | None = None,
        tokens_merged: float = 0.0,
        final: bool = False,
    ) -> Proposal:
        """Merge the answers (by contributor) into the next version, on copies (module docstring).

        `sums`: the round's running sums, every answer already added (`add_answer`), with `reread` to read
        an answer's δ again by contributor (clipped and single answers). Without them the answers carry
        their deltas and are added here. `tokens_merged`: the run's merged tokens before this merge, the
        progress the learners' inner rate followed (`MergeRule.lr_scale`). `final`: the fragment's last merge
        of the run (it closes: `ddiloco.syncer.drain`), Θ_p − Δ without the outer rate and look-ahead
        (`OuterNesterov.step_to`)."""
        if sums is None:
            sums = self.new_sums(rule)
            for ans in answers.values():
                self.add_answer(sums, ans, rule)

            def reread(c: str, out: Mapping[str, torch.Tensor] | None = None) -> Tensors:
                return answers[c].delta  # type: ignore[return-value]

        if reread is None:
            raise ValueError("propose: running sums need a way to reread an answer")
        if set(sums.answers) != set(answers):
            raise ValueError("propose: the round's sums and its answers name different contributors")
        discounts, contributors = [], {}
        for c, ans in sorted(answers.items()):
            h = ans.header
            w, discount = self.weigh(h, rule)
            discounts.append(discount)
            contributors[c] = Contribution(
                h.c_tokens,
                h.c_steps,
                h.c_seconds,
                h.base_version,
                self.version - h.base_version,
                w,
                discount,
            )
        # δ_m = θ_m − Θ_base, so Δ_m = −δ_m; RDA, the mean and clipping commute with the sign flip, which
        # finalize applies with the freshest answer's discount (1.0 when any answer is fresh) in its pass
        done = sums.finalize(reread, rule.robust_clip, scale=-max(discounts), plain=final)
        merged, stats = done.merged, dict(done.stats)
        # the new Θ_p and momentum go to pooled memory (a closed round's, or the buffers this fragment gives
        # back at its commit), written in one pass that reads the current ones: no copies, no fresh pages
        numel, shapes = (
            sum(t.numel() for t in self.theta.values()),
            {n: t.shape for n, t in self.theta.items()},
        )
        pooled = (SYNCER_POOL.take(numel), SYNCER_POOL.take(numel))
        theta, buf = carve(pooled[0], shapes), carve(pooled[1], shapes)
        outer = self.outer.step_to(
            self.theta, merged, theta, buf, lr_scale=rule.lr_scale(tokens_merged), final=final
        )
        sums.recycle(done)  # the step consumed the merged gradient (momentum keeps its own copy)
        return Proposal(
            self.version + 1, theta, outer, contributors, dict(done.clipped), stats, pooled, final=final
        )

    def commit(self, proposal: Proposal, *, published_at: float, clock: float) -> None:
        """Adopt a persisted proposal. `published_at`: wall time before it was written; `clock`: now.
        `theta` stays the fp32 master; the published values (L_v) become the version's base."""
        for buf in self.pooled:  # the replaced Θ_p and momentum: no one else holds them (module docstring)
            SYNCER_POOL.give(buf)
        self.theta, self.outer, self.version = proposal.theta, proposal.outer, proposal.version
        self.pooled, proposal.pooled = proposal.pooled, ()
        self.published_at[self.version] = published_at
        self.published_at.pop(self.version - KEEP_PUBLISHED, None)
        self.merged_clock = clock


def merged_tokens(fragments: Sequence[GlobalFragment]) -> float:
    """The run's merged tokens: the fragments' merged tokens, averaged over the P fragments (each fragment's
    ledger counts the tokens of the answers merged into it)."""
    return sum(f.ledger.merged_tokens for f in fragments) / len(fragments)
