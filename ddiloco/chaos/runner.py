"""One runner fires a schedule's timed events through a backend: the launcher's processes, local pids, or pods.

The runner owns the clock and the bookkeeping (what is due, waiting for a victim, when a stall ends, what was
recorded); a backend acts on one event at a time (`fire`) and says what it did (an Outcome) or that its
victim is not there yet (None). What a backend cannot do is recorded as skipped, with why; what no backend
fires, the processes fire themselves (`ddiloco.chaos.inprocess`). A backend that `persist`s writes each
record once under `chaos/{backend}/{id}.json`, so a retried step never fires an event twice, and a re-run
step records what it missed as skipped instead of firing it late. The step ends when `done.json` appears or
nothing is left to fire.

Design notes (retried and re-run steps): docs/internals.md, "Chaos".
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ddiloco import keys
from ddiloco.chaos.record import ChaosRecord
from ddiloco.config.chaos_schedule import ChaosEvent
from ddiloco.store.base import Store, StoreError

log = logging.getLogger(__name__)

SELF_FIRED = "fired by the learner/syncer process itself"


@dataclass(frozen=True, slots=True)
class Outcome:
    """What a backend did with an event."""

    action: str
    detail: Mapping[str, Any] = field(default_factory=dict)
    resume: Callable[[], bool] | None = None
    """For a stall: ends it (resumes the victim); returns False if the victim is gone already."""


class Backend(Protocol):
    name: str
    persist: bool
    """Records go to the store (`chaos/{name}/{id}.json`), and events recorded there are not fired again."""
    fires: frozenset[str]
    """The event kinds this backend fires when they are due."""
    cannot: Mapping[str, str]
    """Kinds it cannot fire -> the action recorded for them (why they were skipped)."""

    def fire(self, ev: ChaosEvent, store: Store) -> Outcome | None:
        """Act on a due event; None when its victim is not (yet) running, to be tried again later."""


class ChaosRunner:
    """Fires the due events of a schedule through a backend and records each one."""

    def __init__(
        self,
        store: Store,
        backend: Backend,
        events: Sequence[ChaosEvent],
        t0: float,
        *,
        victim_wait_s: float = 120.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store, self.backend, self.t0, self.clock = store, backend, t0, clock
        self.victim_wait_s = victim_wait_s
        self.records: list[ChaosRecord] = []
        self.pending: list[ChaosEvent] = []
        self.stalled: list[tuple[float, ChaosEvent, Callable[[], bool]]] = []
        start = self.clock()
        rerun = backend.persist and self._note_start(start)
        for ev in events:
            if backend.persist and store.exists(keys.chaos_record_key(backend.name, ev.id)):
                continue  # a retried chaos step: this event was handled by an earlier attempt
            if ev.kind in backend.cannot:
                self._record(ev, start, Outcome(backend.cannot[ev.kind]))
            elif ev.kind in backend.fires and ev.at_s is not None:
                if rerun and ev.due(t0) < start:
                    late = f"due at {ev.at_s:g}s, this re-run of the chaos step started at {start - t0:.0f}s"
                    self._record(ev, start, Outcome(f"skipped (missed: {late})"))
                    log.warning("chaos: %s missed (%s)", ev.id, late)
                    continue
                self.pending.append(ev)
            else:
                log.info("chaos: %s (%s) is %s", ev.id, ev.kind, SELF_FIRED)
        self.pending.sort(key=lambda e: e.due(t0))

    def poll(self, now: float | None = None) -> None:
        """End the stalls that are over, then fire every event that is due."""
        now = self.clock() if now is None else now
        for stall in [s for s in self.stalled if now >= s[0]]:
            self.stalled.remove(stall)
            stall[2]()
            self._record(stall[1], now, Outcome("SIGCONT"))
        for ev in [e for e in self.pending if now >= e.due(self.t0)]:
            outcome = self.backend.fire(ev, self.store)
            if outcome is None:
                if now < ev.due(self.t0) + self.victim_wait_s:
                    continue  # not running yet (pending pod, no report): try again at the next poll
                outcome = self._no_victim(ev)
            self.pending.remove(ev)
            if outcome.resume is not None:
                self.stalled.append((now + (ev.duration_s or 0.0), ev, outcome.resume))
            self._record(ev, now, outcome)
            log.warning("chaos: %s at %.1fs: %s", ev.id, now - self.t0, outcome.action)

    def run(
        self,
        poll_s: float = 1.0,
        max_seconds: float | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> list[ChaosRecord]:
        """Poll until `done.json` appears, nothing is left to fire, or `max_seconds` passed."""
        start = self.clock()
        while self.pending or self.stalled:
            try:
                if self.store.exists(keys.DONE):
                    break
                self.poll()
            except StoreError as e:  # the store is away (maybe an injected outage): keep the schedule
                log.warning("chaos: store unavailable (%s); retrying", e)
            if max_seconds is not None and self.clock() - start >= max_seconds:
                break
            if self.pending or self.stalled:
                sleep(poll_s)
        self.release()
        for ev in self.pending:
            log.info("chaos: %s not fired (run ended first)", ev.id)
        return self.records

    def release(self) -> None:
        """Never leave a process stopped behind."""
        for _, ev, resume in self.stalled:
            if resume():
                self._record(ev, self.clock(), Outcome("SIGCONT (run ended)"))
        self.stalled.clear()

    def _note_start(self, now: float) -> bool:
        """Add this attempt's start to the run's chaos steps; True if an earlier attempt started before."""
        key = keys.chaos_step_key(self.backend.name)
        record = self.store.get_json_or_none(key)
        starts = list(record.get("started_at", [])) if isinstance(record, dict) else []
        self.store.put_json(key, {"started_at": [*starts, now]})
        return bool(starts)

    def _no_victim(self, ev: ChaosEvent) -> Outcome:
        role = ev.role()
        who = f"learner {ev.learner}" if role == "learner" else "the syncer"
        return Outcome(f"skipped (no live {role} to kill: {who} not found within {self.victim_wait_s:.0f}s)")

    def _record(self, ev: ChaosEvent, now: float, outcome: Outcome) -> None:
        backend = self.backend.name if self.backend.persist else None
        record = ChaosRecord.at(ev, self.t0, now, outcome.action, backend, **outcome.detail)
        if backend is not None:
            self.store.put_json(keys.chaos_record_key(backend, ev.id), record.to_json())
        self.records.append(record)
