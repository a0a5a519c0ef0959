"""Chaos that every process applies to itself: store outages, and a learner's own kills and slowdowns.

Design choices:
- The orchestrator's backends (`ddiloco.chaos.runner`) fire what can be done from outside; what needs the
  process itself is here: every role wraps its store so an outage window refuses all operations, and a
  learner SIGKILLs itself at an inner step (`at_step`) and runs k× slower (`slow_learner`).
- An `at_step` kill fires once per run, not once per incarnation: it is recorded in the store
  (`chaos/fired/{id}.json`) before the SIGKILL, and a later incarnation that finds the record skips it.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import time
from collections.abc import Callable, Sequence
from typing import Any

from ddiloco import keys
from ddiloco.chaos.record import ChaosRecord
from ddiloco.config.chaos_schedule import ChaosEvent, schedule_from_config
from ddiloco.run.root import RunRoot
from ddiloco.store.base import Store
from ddiloco.store.wrapped import OutageStore

log = logging.getLogger(__name__)


def load_schedule(store: Store, cfg: Any) -> tuple[list[ChaosEvent], float]:
    """The chaos events of `cfg` (the run's `RunConfig`, read from its run root by the caller) and their
    time origin (`prepared_at`), read from the prepared run root."""
    t0 = RunRoot(store, cfg.run_id).prepared_at()
    return schedule_from_config(cfg.chaos, cfg.diloco.learners), time.time() if t0 is None else t0


def chaos_store(store: Store, cfg: Any) -> Store:
    """Wrap a role's store with the outages of the run's config `cfg` (if any); call once at process start."""
    events, t0 = load_schedule(store, cfg)
    return outage_store(store, events, t0)


def outage_store(store: Store, events: Sequence[ChaosEvent], t0: float) -> Store:
    windows = [(e.due(t0), e.due(t0) + (e.duration_s or 0.0)) for e in events if e.kind == "store_outage"]
    return OutageStore(store, windows) if windows else store


class LearnerChaos:
    """What a learner does to itself: die at an inner step (once), run k× slower with jitter."""

    def __init__(
        self, store: Store, events: Sequence[ChaosEvent], learner_id: int, t0: float, seed: int = 0
    ) -> None:
        self.store, self.t0 = store, t0
        self.kills = [
            e
            for e in events
            if e.kind == "kill_learner" and e.learner == learner_id and e.at_step is not None
        ]
        self.slow = [e for e in events if e.kind == "slow_learner" and e.learner == learner_id]
        self.rng = random.Random(seed * 7919 + learner_id)

    def after_step(
        self, inner_step: int, step_seconds: float, kill: Callable[[], None] | None = None
    ) -> float:
        """Called after each inner step; returns extra seconds slept (the slowdown), or never returns (kill)."""
        for ev in [e for e in self.kills if inner_step >= (e.at_step or 0)]:
            self.kills.remove(ev)
            key = keys.chaos_record_key(keys.CHAOS_SELF_FIRED, ev.id)
            if self.store.exists(key):
                continue  # fired in an earlier incarnation
            record = ChaosRecord.at(ev, self.t0, time.time(), "SIGKILL (self)", inner_step=inner_step)
            self.store.put_json(key, record.to_json())
            log.warning("chaos: learner kills itself at inner step %d (event %s)", inner_step, ev.id)
            (kill or _sigkill_self)()
        extra = sum(self._slowdown(ev, step_seconds) for ev in self.slow if time.time() >= ev.due(self.t0))
        if extra > 0:
            time.sleep(extra)
        return extra

    def _slowdown(self, ev: ChaosEvent, step_seconds: float) -> float:
        """Extra seconds after a step of `step_seconds`: k× slower, plus up to `jitter` of a step at random."""
        return ((ev.factor or 1.0) - 1.0) * step_seconds + ev.jitter * step_seconds * self.rng.random()


def _sigkill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)
