"""Whether the syncer keeps the paper's pace: per merged round, the overlap it had and its fragment's sync
period, in learner steps, and what a syncer that falls behind would need.

Measured when a version is published, on the syncer's clock, in steps of ξ_step. The overlap of a round (the
paper's τ) runs from its opening until its version is readable; a fragment's sync period is the time between
two of its versions, H when the syncer keeps up. `syncer_lag` = max(0, mean sync period / H − 1); with the
syncer's `busy_share` it tells a slow quorum from a slow syncer, and a syncer behind logs the threads it
would need. Aggregates only, written to `syncer/pace.json` beside the state and reported by the summary.

Design notes: docs/internals.md, "Keeping the paper's pace".
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass
from typing import Any

log = logging.getLogger(__name__)

LAG_WARN = 0.25
"""Sync period above (1 + LAG_WARN)·H while busy: warn."""
BUSY_WARN = 0.8


@dataclass(slots=True)
class Pace:
    """Run-long aggregates of the pace figures (module docstring)."""

    rounds: int = 0
    overlap_steps_sum: float = 0.0
    overlap_steps_max: float = 0.0
    periods: int = 0
    period_steps_sum: float = 0.0
    busy_seconds: float = 0.0
    """Seconds spent merging (propose) and publishing, summed over rounds."""
    since: float = 0.0
    """Syncer clock when measuring began (this process)."""
    warned_at: float = -math.inf

    def add(self, overlap_steps: float, period_steps: float | None, busy_seconds: float) -> None:
        self.rounds += 1
        self.overlap_steps_sum += overlap_steps
        self.overlap_steps_max = max(self.overlap_steps_max, overlap_steps)
        if period_steps is not None:
            self.periods += 1
            self.period_steps_sum += period_steps
        self.busy_seconds += busy_seconds

    def figures(self, sync_every: int, overlap: int, threads: int, now: float) -> dict[str, Any]:
        """The summary's `sync_pace`: means in learner steps, the lag, the busy share, the threads needed."""
        mean_overlap = self.overlap_steps_sum / self.rounds if self.rounds else None
        period = self.period_steps_sum / self.periods if self.periods else None
        lag = max(0.0, period / sync_every - 1.0) if period is not None else None
        busy = self.busy_seconds / (now - self.since) if now > self.since else None
        behind = lag is not None and lag > LAG_WARN and busy is not None and busy >= BUSY_WARN
        return {
            "rounds_measured": self.rounds,
            "mean_overlap_steps": mean_overlap,
            "max_overlap_steps": self.overlap_steps_max if self.rounds else None,
            "overlap_bound_steps": overlap,
            "mean_sync_period_steps": period,
            "sync_every": sync_every,
            "syncer_lag": lag,
            "busy_share": busy,
            "syncer_threads": threads,
            "syncer_threads_needed": math.ceil(threads * (1.0 + lag)) if behind and lag is not None else None,
        }

    def warn_if_behind(self, sync_every: int, overlap: int, threads: int, now: float) -> None:
        """One warning per minute at most while the syncer cannot keep up (module docstring)."""
        f = self.figures(sync_every, overlap, threads, now)
        if f["syncer_threads_needed"] is None or now - self.warned_at < 60.0:
            return
        self.warned_at = now
        log.warning(
            "syncer: cannot keep up: fragments are synced every %.1f learner steps (H = %d), rounds overlap "
            "%.1f steps on average (τ = %d), busy %.0f%% of the time; give the syncer about %d threads/CPUs "
            "(now %d) or raise diloco.sync_every",
            f["mean_sync_period_steps"],
            sync_every,
            f["mean_overlap_steps"],
            overlap,
            100 * f["busy_share"],
            f["syncer_threads_needed"],
            threads,
        )

    def state_dict(self) -> dict[str, Any]:
        """The aggregates, what a restarted syncer continues from (`ddiloco.stateful.Stateful`). The busy
        share is this process's: a restart measures it afresh."""
        out = asdict(self)
        del out["since"], out["warned_at"]  # this process's clock: meaningless to the next one
        return out

    def load_state_dict(self, state: Any) -> None:
        """Every aggregate of `state` that is usable (anything unreadable starts afresh); `busy_seconds`
        stays this process's, measured afresh like the busy share it makes."""
        if isinstance(state, dict):
            for name in ("rounds", "periods"):
                x = state.get(name)
                if isinstance(x, int) and not isinstance(x, bool) and x >= 0:
                    setattr(self, name, x)
            for name in ("overlap_steps_sum", "overlap_steps_max", "period_steps_sum"):
                x = state.get(name)
                if isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) and x >= 0:
                    setattr(self, name, float(x))

    def to_json(self, figures: dict[str, Any]) -> dict[str, Any]:
        """syncer/pace.json: the aggregates and the `figures` now (what the summary reports)."""
        return {**self.state_dict(), "figures": figures}

    @classmethod
    def from_json(cls, obj: Any, since: float) -> Pace:
        """What a restarted syncer continues from (anything unreadable starts afresh)."""
        pace = cls(since=since)
        pace.load_state_dict(obj)
        return pace
