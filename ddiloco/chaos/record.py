"""What chaos did with an event: one record type, written by the runner and by a learner killing itself.

Design choices:
- A record is the event's own fields plus when (`time_s` since the schedule's origin, `fired_at` epoch), what
  was done (`action`, e.g. "SIGKILL", "deleted pod", "skipped (...)") and the backend's details (`pid`,
  `pod`, ...); `summary.json` lists the records of a run as `chaos_events`, sorted by `time_s`.
- `backend` is set only on records a chaos step writes to the store (`chaos/{backend}/{id}.json`); the
  local launcher keeps its records in `launcher/events.json` and a learner's own kill in `chaos/fired/`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ddiloco.config.chaos_schedule import ChaosEvent


@dataclass(frozen=True, slots=True)
class ChaosRecord:
    event: ChaosEvent
    time_s: float
    """Seconds since the schedule's origin (`prepared_at`), to the millisecond."""
    fired_at: float
    """Epoch seconds."""
    action: str
    backend: str | None = None
    detail: Mapping[str, Any] = field(default_factory=dict)
    """What the backend reports: `pid`, `host`, `pod`, `namespace`, `inner_step`, ..."""

    @classmethod
    def at(
        cls, event: ChaosEvent, t0: float, now: float, action: str, backend: str | None = None, **detail: Any
    ) -> ChaosRecord:
        return cls(event, round(now - t0, 3), now, action, backend, detail)

    def to_json(self) -> dict[str, Any]:
        backend = {} if self.backend is None else {"backend": self.backend}
        when = {"time_s": self.time_s, "fired_at": self.fired_at, "action": self.action}
        return {**self.event.to_json(), **backend, **when, **self.detail}


def markdown_table(records: Sequence[ChaosRecord]) -> str:
    """What a chaos step did, for the KFP UI (a Markdown artifact)."""
    lines = ["# Chaos events", "", "| id | kind | target | at (s) | action |", "|---|---|---|---|---|"]
    for r in records:
        ev = r.event
        target = r.detail.get("pod") or (f"pid {r.detail['pid']}" if "pid" in r.detail else "")
        who = (
            f"learner {ev.learner}"
            if ev.learner is not None
            else ("syncer" if ev.kind == "kill_syncer" else "")
        )
        lines.append(f"| {ev.id} | {ev.kind} | {who} {target} | {r.time_s:.1f} | {r.action} |")
    if not records:
        lines.append("| | | | | nothing fired |")
    return "\n".join(lines) + "\n"
