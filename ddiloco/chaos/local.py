"""Chaos schedules as data, and the local backend that fires them at real processes.

Design choices (torchft's EventInjector, declared up front as data):
- A schedule is a list of events, each with a stable id; Poisson kills are expanded into plain events from
  a seed, so a schedule is reproducible and printable before the run starts.
- Times (`at_s`) count from `prepared_at` in `data/meta.json`, one clock for every process and backend.
- Who fires what: the orchestrator backend (local processes here, Kubernetes pods in `chaos_k8s.py`) fires
  timed kills, stalls, syncer kills and added learners; the learner itself fires `at_step` kills (a real
  SIGKILL of its own process, once: the event is recorded in the store first) and runs k× slower; every
  process wraps its store so an outage window refuses all operations.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from ddiloco.store import Store
from ddiloco.store.wrapped import OutageStore

log = logging.getLogger(__name__)

KINDS: dict[str, tuple[set[str], set[str]]] = {
    # kind: (required fields, optional fields)
    "kill_learner": ({"learner"}, {"at_s", "at_step"}),
    "stall_learner": ({"learner", "at_s", "duration_s"}, set()),
    "slow_learner": ({"learner", "factor"}, {"jitter", "at_s"}),
    "kill_syncer": ({"at_s"}, set()),
    "store_outage": ({"at_s", "duration_s"}, set()),
    "add_learner": ({"learner", "at_s"}, set()),
}
FIELDS = {"id", "kind", "learner", "at_s", "at_step", "duration_s", "factor", "jitter"}


class ChaosConfigError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class ChaosEvent:
    id: str
    kind: str
    learner: int | None = None
    at_s: float | None = None
    at_step: int | None = None
    duration_s: float | None = None
    factor: float | None = None
    jitter: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


def parse_event(raw: Mapping[str, Any], index: int) -> ChaosEvent:
    where = f"chaos.events[{index}]"
    if not isinstance(raw, Mapping):
        raise ChaosConfigError(f"{where} must be a mapping like {{kind: kill_learner, learner: 1, at_s: 30}}")
    kind = raw.get("kind")
    if kind not in KINDS:
        raise ChaosConfigError(f"{where}.kind={kind!r}: choose one of {', '.join(KINDS)}")
    required, optional = KINDS[kind]
    unknown = set(raw) - FIELDS
    if unknown:
        raise ChaosConfigError(f"{where} has unknown field(s) {sorted(unknown)}; allowed: {sorted(FIELDS)}")
    missing = required - set(raw)
    if missing:
        raise ChaosConfigError(f"{where} ({kind}) needs {sorted(missing)}")
    extra = set(raw) - required - optional - {"id", "kind"}
    if extra:
        raise ChaosConfigError(f"{where} ({kind}) does not take {sorted(extra)}")
    if kind == "kill_learner" and ("at_s" in raw) == ("at_step" in raw):
        raise ChaosConfigError(f"{where} (kill_learner) needs exactly one of at_s or at_step")
    ev = ChaosEvent(
        id=str(raw.get("id", f"{kind}-{index}")),
        kind=kind,
        learner=_num(raw, "learner", int, where),
        at_s=_num(raw, "at_s", float, where),
        at_step=_num(raw, "at_step", int, where),
        duration_s=_num(raw, "duration_s", float, where),
        factor=_num(raw, "factor", float, where),
        jitter=_num(raw, "jitter", float, where) or 0.0,
    )
    if ev.at_s is not None and ev.at_s < 0 or ev.duration_s is not None and ev.duration_s <= 0:
        raise ChaosConfigError(f"{where}: at_s must be ≥ 0 and duration_s > 0")
    if ev.factor is not None and ev.factor < 1:
        raise ChaosConfigError(f"{where}: factor must be ≥ 1 (a k× slower learner)")
    if not 0 <= ev.jitter <= 1:
        raise ChaosConfigError(f"{where}: jitter must be in [0, 1] (a fraction of the step time)")
    return ev


def _num(raw: Mapping[str, Any], key: str, typ: type, where: str) -> Any:
    if key not in raw or raw[key] is None:
        return None
    value = raw[key]
    if isinstance(value, bool) or not isinstance(value, int | float) or (typ is int and int(value) != value):
        raise ChaosConfigError(
            f"{where}.{key}={value!r} must be {'an integer' if typ is int else 'a number'}"
        )
    return typ(value)


def poisson_kills(
    mean_interval_s: float, seed: int, start_s: float, stop_s: float, learners: Sequence[int]
) -> list[ChaosEvent]:
    """Kill times with exponential gaps (mean `mean_interval_s`), each hitting a uniformly drawn learner."""
    if mean_interval_s <= 0 or not learners:
        raise ChaosConfigError("chaos.poisson needs mean_interval_s > 0 and at least one learner")
    rng = random.Random(seed)
    out, t = [], start_s
    while True:
        t += rng.expovariate(1.0 / mean_interval_s)
        if t >= stop_s:
            return out
        out.append(
            ChaosEvent(
                id=f"poisson-{len(out)}",
                kind="kill_learner",
                learner=rng.choice(list(learners)),
                at_s=round(t, 3),
            )
        )


def schedule_from_config(chaos: Any, learners: int) -> list[ChaosEvent]:
    """The full, validated event list of a `ChaosConfig` (None → no events)."""
    if chaos is None:
        return []
    events = [parse_event(raw, i) for i, raw in enumerate(chaos.events)]
    if chaos.poisson is not None:
        p = chaos.poisson
        pool = p.learners if p.learners is not None else list(range(learners))
        events += poisson_kills(
            p.mean_interval_s, p.seed, p.start_s, p.stop_s if p.stop_s is not None else 3600.0, pool
        )
    ids = [e.id for e in events]
    if len(set(ids)) != len(ids):
        raise ChaosConfigError(f"chaos event ids must be unique: {ids}")
    return events


def load_schedule(store: Store) -> tuple[list[ChaosEvent], float]:
    """The run's chaos events and their time origin (`prepared_at`), read from a prepared run root."""
    from ddiloco.config import RunConfig

    cfg = RunConfig.from_dict(store.get_json("config.json"))
    meta = store.get_json("data/meta.json")
    return schedule_from_config(cfg.chaos, cfg.diloco.learners), float(meta.get("prepared_at", time.time()))


def chaos_store(store: Store) -> Store:
    """Wrap a role's store with the run's injected outages (if any); call once at process start."""
    events, t0 = load_schedule(store)
    return outage_store(store, events, t0)


# --- in-process hooks ------------------------------------------------------------------------------------------
def fired_key(event_id: str) -> str:
    return f"chaos/fired/{event_id}.json"


def record_fired(store: Store, ev: ChaosEvent, t0: float, **detail: Any) -> dict[str, Any]:
    rec = {**ev.to_json(), "time_s": time.time() - t0, "fired_at": time.time(), **detail}
    store.put_json(fired_key(ev.id), rec)
    return rec


def outage_store(store: Store, events: Sequence[ChaosEvent], t0: float) -> Store:
    windows = [(t0 + e.at_s, t0 + e.at_s + e.duration_s) for e in events if e.kind == "store_outage"]  # type: ignore[operator]
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
        for ev in list(self.kills):
            if inner_step >= ev.at_step:  # type: ignore[operator]
                self.kills.remove(ev)
                if self.store.exists(fired_key(ev.id)):
                    continue  # fired in an earlier incarnation
                record_fired(self.store, ev, self.t0, inner_step=inner_step, action="SIGKILL (self)")
                log.warning("chaos: learner kills itself at inner step %d (event %s)", inner_step, ev.id)
                (kill or _sigkill_self)()
        extra = 0.0
        now = time.time() - self.t0
        for ev in self.slow:
            if now >= (ev.at_s or 0.0):
                extra += (ev.factor - 1.0) * step_seconds + ev.jitter * step_seconds * self.rng.random()  # type: ignore[operator]
        if extra > 0:
            time.sleep(extra)
        return extra


def _sigkill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


# --- the local backend -----------------------------------------------------------------------------------------
class LocalChaos:
    """Fires timed events at the processes of a `LocalRun` (real SIGKILL / SIGSTOP / SIGCONT)."""

    def __init__(self, events: Sequence[ChaosEvent], run: Any, t0: float) -> None:
        self.pending = sorted(
            (e for e in events if e.at_s is not None and e.kind != "slow_learner"), key=lambda e: e.at_s
        )
        self.run, self.t0 = run, t0
        self.stalled: list[tuple[float, Any, ChaosEvent]] = []
        self.fired: list[dict[str, Any]] = []

    def poll(self, now: float | None = None) -> None:
        now = time.time() if now is None else now
        for until, proc, ev in list(self.stalled):
            if now >= until:
                self.stalled.remove((until, proc, ev))
                if proc.popen is not None and proc.popen.poll() is None:
                    proc.popen.send_signal(signal.SIGCONT)
                self._record(ev, now, action="SIGCONT")
        while self.pending and now >= self.t0 + self.pending[0].at_s:  # type: ignore[operator]
            self._fire(self.pending.pop(0), now)

    def _fire(self, ev: ChaosEvent, now: float) -> None:
        if ev.kind == "kill_learner" or ev.kind == "kill_syncer":
            proc = self.run.find("syncer" if ev.kind == "kill_syncer" else "learner", ev.learner)
            if proc is None or proc.popen is None or proc.popen.poll() is not None:
                self._record(ev, now, action="skipped (not running)")
                return
            proc.popen.send_signal(signal.SIGKILL)
            self._record(ev, now, action="SIGKILL", pid=proc.popen.pid)
        elif ev.kind == "stall_learner":
            proc = self.run.find("learner", ev.learner)
            if proc is None or proc.popen is None or proc.popen.poll() is not None:
                self._record(ev, now, action="skipped (not running)")
                return
            proc.popen.send_signal(signal.SIGSTOP)
            self.stalled.append((now + ev.duration_s, proc, ev))  # type: ignore[operator]
            self._record(ev, now, action="SIGSTOP", pid=proc.popen.pid)
        elif ev.kind == "add_learner":
            self.run.add_learner(ev.learner)
            self._record(ev, now, action="started")
        elif ev.kind == "store_outage":
            self._record(ev, now, action=f"outage for {ev.duration_s}s (every process refuses store calls)")
        log.warning("chaos: %s fired at %.1fs", ev.id, now - self.t0)

    def _record(self, ev: ChaosEvent, now: float, **detail: Any) -> None:
        self.fired.append({**ev.to_json(), "time_s": round(now - self.t0, 3), "fired_at": now, **detail})

    def release(self) -> None:
        """Never leave a process stopped behind."""
        for _, proc, ev in self.stalled:
            if proc.popen is not None and proc.popen.poll() is None:
                proc.popen.send_signal(signal.SIGCONT)
                self._record(ev, time.time(), action="SIGCONT (run ended)")
        self.stalled.clear()
