"""The inner learning-rate schedule: warm-up on the caller's own steps, decay on the run's global progress.

lr = train.lr · warmup(step) · decay(progress), a pure function (`inner_lr`: `lr_at` with the train config)
shared by learners, their data-parallel ranks and the baseline. Warm-up is linear over the caller's own first
`train.warmup_steps` inner steps, so a late joiner ramps up too. Decay (`train.lr_schedule`: cosine, linear,
wsd, constant, or `auto`, resolved from the config alone) follows the fraction of `diloco.token_budget`
merged, which a learner reads from the newest syncer status (`GlobalSchedule`): the same monotone number for
every learner, held between statuses, kept in whole tokens so every rank computes the identical rate. The
syncer's outer momentum follows the same decay (`diloco.momentum_follows_lr`).

Design notes (what `auto` resolves to and why): docs/internals.md, "The inner learning rate".
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ddiloco.config.run import RunConfig, TrainConfig
    from ddiloco.protocol.messages import Status

__all__ = [
    "GlobalSchedule",
    "decay_factor",
    "decay_of",
    "inner_lr",
    "learner_train",
    "lr_at",
    "outer_steps_in_decay",
    "progress_of",
    "resolve",
    "warmup_factor",
]


def warmup_factor(step: int, warmup_steps: int) -> float:
    """Linear warm-up: (step + 1) / warmup_steps, capped at 1 (1 throughout when warmup_steps ≤ 1)."""
    return min(1.0, (step + 1) / max(1, warmup_steps))


def progress_of(tokens: float, budget: float) -> float:
    """Global progress: tokens / budget clamped to [0, 1] (a run may merge a little past its budget)."""
    if budget <= 0 or not math.isfinite(tokens):
        return 0.0
    return min(1.0, max(0.0, tokens / budget))


def decay_factor(progress: float, schedule: str, min_ratio: float, decay_fraction: float = 0.2) -> float:
    """Multiplier of the peak rate at `progress` ∈ [0, 1] (clamped): 1 at 0, `min_ratio` at 1 and beyond.

    `wsd` holds the peak until 1 − `decay_fraction`, then cools down as 1 − sqrt of the cool-down's progress."""
    x = min(1.0, max(0.0, progress))
    if schedule == "constant":
        return 1.0
    if schedule == "wsd":
        cool = max(0.0, x - (1.0 - decay_fraction)) / decay_fraction
        return min_ratio + (1.0 - min_ratio) * (1.0 - math.sqrt(cool))
    if schedule == "linear":
        return 1.0 - (1.0 - min_ratio) * x
    if schedule in ("cosine", "auto"):  # auto: cosine where it is not resolved (data-parallel)
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * x))
    raise ValueError(f"unknown learning-rate schedule {schedule!r}; choose cosine, linear, wsd or constant")


def outer_steps_in_decay(cfg: RunConfig, schedule: str = "cosine") -> float:
    """Outer steps each fragment takes while `schedule` decays, as planned by the config: rounds per fragment
    = budget / (M · ranks · batch · seq_len · H) (a fragment is synced every H learner steps), times the
    share of the run the decay spans (all of it for cosine and linear, `lr_decay_fraction` for wsd)."""
    d, t = cfg.diloco, cfg.train
    tokens_per_step = max(1, d.learners * t.ranks * t.batch_size * cfg.model.seq_len)
    rounds = d.token_budget / tokens_per_step / max(1, d.sync_every)
    return rounds * (t.lr_decay_fraction if schedule == "wsd" else 1.0)


def resolve(cfg: RunConfig) -> str:
    """The inner schedule Decoupled DiLoCo's learners (and the outer momentum) follow: `train.lr_schedule`,
    or for `auto`, cosine when the decay spans at least the outer momentum's horizon 1/(1 − μ) outer steps
    per fragment (`outer_steps_in_decay`), else constant. The decay reaches the global model only through
    outer steps; over fewer of them than the momentum's horizon it only takes progress away (module
    docstring: measured)."""
    t = cfg.train
    if t.lr_schedule != "auto":
        return t.lr_schedule
    horizon = 1.0 / (1.0 - cfg.diloco.outer_momentum)
    return "cosine" if outer_steps_in_decay(cfg) >= horizon else "constant"


def learner_train(cfg: RunConfig) -> TrainConfig:
    """`cfg.train` with `train.lr_schedule` resolved for the learners (`resolve`)."""
    return dataclasses.replace(cfg.train, lr_schedule=resolve(cfg))


def decay_of(progress: float, t: TrainConfig) -> float:
    """`decay_factor` with the schedule of `t` (train.lr_schedule, lr_min_ratio, lr_decay_fraction)."""
    return decay_factor(progress, t.lr_schedule, t.lr_min_ratio, t.lr_decay_fraction)


def lr_at(
    step: int,
    peak: float,
    warmup_steps: int,
    *,
    progress: float = 0.0,
    schedule: str = "constant",
    min_ratio: float = 1.0,
    decay_fraction: float = 0.2,
) -> float:
    """The learning rate of step `step` (the caller's own count): `peak` · `warmup_factor(step, warmup_steps)`
    · `decay_factor(progress, schedule, min_ratio, decay_fraction)`. The defaults decay nothing (warm-up
    only); every schedule of the package is this one function with its own parameters: the learners' and the
    baseline's (`inner_lr`) and supervised fine-tuning's (`ddiloco.posttrain.sft.sft_lr`)."""
    return (
        peak * warmup_factor(step, warmup_steps) * decay_factor(progress, schedule, min_ratio, decay_fraction)
    )


def inner_lr(progress: float, step: int, t: TrainConfig) -> float:
    """The inner learning rate of inner step `step` at global `progress`: `lr_at` with the schedule of `t`
    (train.lr, warmup_steps, lr_schedule, lr_min_ratio, lr_decay_fraction)."""
    return lr_at(
        step,
        t.lr,
        t.warmup_steps,
        progress=progress,
        schedule=t.lr_schedule,
        min_ratio=t.lr_min_ratio,
        decay_fraction=t.lr_decay_fraction,
    )


class GlobalSchedule:
    """A learner's view of the schedule: the newest tokens merged from the syncer's status, never going back.

    `observe(status)` once per step boundary (rank 0 sends `tokens` to its other ranks), then `lr(step)`."""

    def __init__(self, t: TrainConfig, token_budget: int) -> None:
        self.train, self.budget = t, token_budget
        self.tokens = 0
        """Whole tokens merged, as the newest status said (monotone)."""
        self.last_lr: float | None = None
        """The rate `lr` last handed out (the learner's report and metrics)."""

    def observe(self, status: Status | None) -> int:
        """Take `tokens_merged` from a status (ignored when missing, not finite or older); returns tokens."""
        merged = None if status is None else status.tokens_merged
        if merged is not None and math.isfinite(merged):
            self.tokens = max(self.tokens, int(merged))
        return self.tokens

    @property
    def progress(self) -> float:
        return progress_of(self.tokens, self.budget)

    def lr(self, step: int) -> float:
        self.last_lr = inner_lr(self.progress, step, self.train)
        return self.last_lr
