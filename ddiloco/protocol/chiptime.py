"""Learner chip-time: how fast a learner really steps, and how much of its provisioned time it trained.

A learner measures its cadence on its own monotonic clock (`StepCadence`): the seconds from one inner step's
end to the next's, loop overhead included, which is what the syncer paces rounds by (`step_wall_ema`),
never a comparison of two machines' clocks. The same intervals, summed, are its productive seconds; an
interval far longer than the cadence is a stall, of which only a cadence's worth counts. Goodput is the
paper's quantity, productive over provisioned learner seconds, a learner id being provisioned from its first
join to the end of the run; provisioned time is measured on the learner's own clock wherever it can be, so
a clean run's goodput does not depend on clock skew.

Design notes (why compute time alone under-counts, what counts as lost): docs/internals.md,
"Cadence and chip-time".
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

EMA = 0.1
WARMUP_SAMPLES = 5
STALL_FACTOR = 5.0
MIN_STALL_S = 1.0


class StepCadence:
    """Wall seconds per inner step, loop overhead included (EMA), and productive seconds, on one clock."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.productive_seconds = 0.0
        self._ema: float | None = None
        self._samples: list[float] = []  # the first round(1/EMA) intervals
        self._last_end: float | None = None
        self._steps = 0

    @property
    def ema(self) -> float | None:
        """Seconds per step; None until `WARMUP_SAMPLES` intervals were seen (a first interval alone is often
        far off, and the syncer would pace rounds by it until the next report)."""
        return self._ema if len(self._samples) >= WARMUP_SAMPLES else None

    @property
    def just_measured(self) -> bool:
        """True right after the cadence became known: worth a report, the syncer paces rounds by it."""
        return len(self._samples) == WARMUP_SAMPLES and self._steps == WARMUP_SAMPLES + 1

    def begin(self) -> None:
        """The training loop starts (the learner joined the run): its time is productive from here."""
        self._last_end = self.clock()

    def step_done(self, compute_s: float) -> None:
        """Call at the end of every inner step. Without `begin`, the first step's compute time `compute_s`
        counts as productive; the cadence starts with the interval between the first two step ends. It is
        the median of the first round(1/EMA) intervals (the first steps meet one-off costs: a first merge,
        first downloads), an EMA from there on."""
        now, last = self.clock(), self._last_end
        self._last_end = now
        self._steps += 1
        if last is None or self._steps == 1:  # no step end before this one: not a cadence sample
            self.productive_seconds += compute_s if last is None else now - last
            return
        interval = now - last
        if self._ema is not None:  # the rest of a stall is lost time, and no cadence sample
            self.productive_seconds += min(interval, max(STALL_FACTOR * self._ema, MIN_STALL_S))
            interval = min(interval, STALL_FACTOR * self._ema)
        else:
            self.productive_seconds += interval
        if len(self._samples) < round(1 / EMA):
            self._samples.append(interval)
            self._ema = statistics.median(self._samples)
        else:
            self._ema = (1 - EMA) * self._ema + EMA * interval  # type: ignore[operator]

    def finish(self) -> None:
        """The loop ends (the run is done, or the learner stops): winding down since the last step counts."""
        if self._last_end is not None:
            self.productive_seconds += self.clock() - self._last_end
            self._last_end = None


class Incarnation(Protocol):
    """What goodput reads of one incarnation's report: a `ddiloco.protocol.learner_report.LearnerReport`,
    or the syncer's checked view of one (`ddiloco.protocol.reports.CheckedReport`)."""

    @property
    def incarnation(self) -> int: ...
    @property
    def time(self) -> float: ...
    @property
    def started_at(self) -> float: ...
    @property
    def joined_at(self) -> float | None: ...
    @property
    def final(self) -> bool: ...
    @property
    def exit_reason(self) -> str | None: ...
    @property
    def productive_seconds(self) -> float | None: ...
    @property
    def busy_seconds(self) -> float | None: ...


def productive_seconds(report: Incarnation) -> float:
    """An incarnation's productive seconds; reports written before the field existed give compute time."""
    v = report.productive_seconds
    return float(v if v is not None else report.busy_seconds or 0.0)


def cadence(report: Mapping[str, Any]) -> float | None:
    """Wall seconds per step of a report's JSON (read where the report is parsed): its loop cadence (None
    until measured), or compute time for a learner too old to report a cadence."""
    if "step_wall_ema" in report:
        return report["step_wall_ema"] or None
    return report.get("step_time_ema") or None


def learner_chip_time(incarnations: Iterable[Incarnation], end: float | None) -> tuple[float, float]:
    """(productive, provisioned) seconds of one learner id from the reports of its incarnations.

    Provisioned: from the moment the learner id first joined the run (its first incarnation's `joined_at`;
    setting up the run is not a failure) to `end` (the run's end or now; None: the newest report), or to the
    newest report when that one is final because the run was done (the learner's own clock). A later
    incarnation's start-up is lost time: it happens only because the previous one died."""
    incs = sorted(incarnations, key=lambda r: r.incarnation)
    if not incs:
        return 0.0, 0.0
    newest = incs[-1]
    stop = newest.time
    if end is not None and not (newest.final and newest.exit_reason == "done"):
        stop = max(stop, end)
    first = incs[0].joined_at or incs[0].started_at
    provisioned = max(stop - first, 0.0)
    productive = min(sum(productive_seconds(r) for r in incs), provisioned)
    return productive, provisioned


def goodput(per_learner: Iterable[tuple[float, float]], missing_seconds: float = 0.0) -> float | None:
    """Σ productive / Σ provisioned over learner ids; `missing_seconds`: provisioned time of learner ids
    that never reported (all of it lost). None before anything was provisioned."""
    pairs = list(per_learner)
    provisioned = sum(p for _, p in pairs) + missing_seconds
    return sum(t for t, _ in pairs) / provisioned if provisioned > 0 else None
