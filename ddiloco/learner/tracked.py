"""What a learner logs for experiment tracking (`ddiloco.tracking`): its TensorBoard run `tb/learner-{id}/`,
at its inner step. Each call only queues (`Tracker.scalars`); the learner never waits on a backend.

- Every step: `train/loss` (this step's; on CUDA the previous one, read a step late), `train/lr`,
  `train/tokens_per_second` (EMA of the step time), `train/step_seconds`.
- At each report (heartbeat): `learner/rounds_answered`, `learner/bytes_uploaded`, `learner/bytes_downloaded`,
  `learner/tokens_processed`, `learner/tokens_merged`, `learner/tokens_discarded` (this incarnation's books,
  summed over fragments).
"""

from __future__ import annotations

from typing import Any


def track_step(learner: Any, tokens: int, loss: float | None) -> None:
    """After a step of `tokens` tokens (`learner`: `ddiloco.learner.loop.Learner`, which imports this)."""
    if not learner.tracker.enabled:
        return
    ema = learner.step_time_ema
    values = {
        "train/loss": loss,
        "train/lr": learner.schedule.last_lr,
        "train/tokens_per_second": tokens / ema if ema else None,
        "train/step_seconds": ema,
    }
    learner.tracker.scalars(values, learner.inner_step)


def track_report(learner: Any) -> None:
    """At a heartbeat: traffic and token books so far."""
    if not learner.tracker.enabled:
        return
    up, down, _ = learner.exchange.traffic()
    books = list(learner.ledger)
    values = {
        "learner/rounds_answered": learner.exchange.rounds_answered,
        "learner/bytes_uploaded": up,
        "learner/bytes_downloaded": down,
        "learner/tokens_processed": learner.ledger.tokens_processed,
        "learner/tokens_merged": sum(b.merged_tokens for b in books),
        "learner/tokens_discarded": sum(b.discarded_tokens for b in books),
    }
    learner.tracker.scalars(values, learner.inner_step)
