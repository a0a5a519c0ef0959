"""Shared test helpers: a tiny run config and an in-process driver for learners + syncer."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from ddiloco.config.recipes import load_config
from ddiloco.config.run import RunConfig
from ddiloco.protocol.learner_report import LearnerReport
from ddiloco.protocol.messages import Status

TINY = [
    "model.n_layer=1",
    "model.n_head=2",
    "model.n_embd=32",
    "model.seq_len=32",
    "train.batch_size=4",
    "train.heartbeat_every_s=0.2",
    "train.warmup_steps=2",
    "data.synthetic_docs=600",
    "data.synthetic_entities=8",
    "diloco.learners=2",
    "diloco.fragments=2",
    "diloco.sync_every=4",
    "diloco.token_budget=12000",
    "eval.val_batches=2",
    "eval.items_per_task=8",
    "eval.curve_points=3",
    "sft.steps=20",
    "sft.items_per_kind=40",
    "sft.eval_items=16",
]


def tiny_config(run_id: str, *overrides: str, recipe: str | None = None) -> RunConfig:
    cfg = load_config(recipe, None, [*TINY, *overrides])
    cfg.run_id = run_id
    return cfg


def status(**fields: Any) -> Status:
    """A syncer status with nothing open, merged or rejected; `fields`: the ones a test sets."""
    empty = Status(
        run_id="", time=0.0, syncer_incarnation=0, done=False, syncer_host="", syncer_pid=0, next_round=0,
        versions=[], open_rounds=[], merged=[], tokens_merged=0, token_budget=0, rounds_merged=0,
        live_learners=0, loss=math.nan, rejected={}, clipped={}, rejections=[],
    )  # fmt: skip
    return dataclasses.replace(empty, **fields)


def learner_report(**fields: Any) -> LearnerReport:
    """A learner report of an incarnation that has done nothing yet; `fields`: the ones a test sets."""
    empty = LearnerReport(
        run_id="", learner_id=0, incarnation=0, seq=0, time=0.0, started_at=0.0, joined_at=None, inner_step=0,
        host="", pid=0, site="local", tokens_processed=0, busy_seconds=0.0, loss=None, loss_ema=None,
        step_time_ema=None, rounds_answered=0, step_wall_ema=None, productive_seconds=0.0, bytes_up=0,
        bytes_down=0, upload_failures=0, final=False, exit_reason=None, fragments={}, rejected_globals={},
        rejected_updates={}, history=[], lr=None, progress=0.0,
    )  # fmt: skip
    return dataclasses.replace(empty, **fields)


def train_in_process(store, num_learners: int) -> int:
    """Open the prepared run's syncer and learners 0..num_learners-1 in this process and drive them to the end."""
    from ddiloco.learner.loop import Learner
    from ddiloco.syncer.loop import Syncer

    syncer = Syncer.open(store, poll_s=0)
    learners = [Learner.open(store, i) for i in range(num_learners)]
    for learner in learners:
        learner.start()
    return drive(syncer, learners)


def drive(syncer, learners, max_iters: int = 20000) -> int:
    """Interleave syncer passes and learner steps in one thread until the syncer finishes."""
    for i in range(max_iters):
        if syncer.step():
            for learner in learners:
                learner.poller.poll_once()
                assert learner.tick() is False
                learner.close("done")
            return i
        for learner in learners:
            learner.poller.poll_once()
            learner.tick()
    raise AssertionError("the run did not finish")
