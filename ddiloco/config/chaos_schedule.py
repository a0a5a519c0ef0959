"""Chaos schedules as data: the events of a run's `chaos:` section, validated, with Poisson kills expanded.

Design choices (torchft's EventInjector, declared up front as data):
- A schedule is a list of events, each with a stable id; Poisson kills are expanded into plain events from
  a seed, so a schedule is reproducible and printable before the run starts.
- Times (`at_s`) count from `prepared_at` in `data/meta.json`, one clock for every process and backend.
- One dataclass for every kind: a kind's required and optional fields are in KINDS and checked when parsed,
  so the fields a kind does not take are None (and never read).
- A leaf below the config: `ddiloco.config.run` validates a `chaos:` section with `schedule_from_config`, and
  a bad section raises ChaosConfigError, a ConfigError.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from ddiloco.errors import ConfigError

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


class ChaosConfigError(ConfigError):
    """A bad `chaos:` section; a ConfigError, so `RunConfig.validate` (which calls `schedule_from_config`)
    reports it like any other config mistake."""


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

    def due(self, t0: float) -> float:
        """When the event starts, in epoch seconds (`at_s` after t0; an event without `at_s` at t0)."""
        return t0 + (self.at_s or 0.0)

    def role(self) -> str:
        """The role of the process the event targets."""
        return "syncer" if self.kind == "kill_syncer" else "learner"


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
