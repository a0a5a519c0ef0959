"""The syncer's view of the learners: their reports, who is live, their cadence and the run's goodput.

Liveness is judged on this syncer's own clock only, by when it saw a report change, never by the time the
learner's host wrote into it: five missed heartbeats (at least 3 s) mean dead, and a final report is not live.
Joins and losses of learner incarnations are recorded as events for the summary. Reports are unsigned, so
every number is checked first (`ddiloco.protocol.reports`) and an unusable one treated as missing, logged and
counted. The fastest cadence each live incarnation reported feeds the claim bounds (`pace`).

Design notes: docs/internals.md, "The learners as the syncer sees them".
"""

from __future__ import annotations

import dataclasses
import logging
import math
import statistics
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

from ddiloco import keys
from ddiloco.protocol import chiptime, reports, signing, validation
from ddiloco.protocol.claims import Pace
from ddiloco.protocol.messages import LearnerEvent
from ddiloco.protocol.reports import CheckedReport
from ddiloco.store.base import Store, StoreError

log = logging.getLogger(__name__)


class Roster:
    def __init__(
        self,
        store: Store,
        *,
        clock: Callable[[], float],
        wall: Callable[[], float],
        heartbeat_s: float,
        keys_: signing.RunKeys | None = None,
    ) -> None:
        """`keys_`: the run's keys; a report not signed with the learner key is ignored whole (counted)."""
        self.store, self.clock, self.wall, self.keys = store, clock, wall, keys_
        self.timeout_s = max(3.0, 5 * heartbeat_s)
        self.reports: dict[int, CheckedReport] = {}
        """learner id -> its newest incarnation's newest report."""
        self.heard: dict[int, tuple[tuple[int, int], float]] = {}
        """learner id -> ((incarnation, seq) of its newest report, this syncer's `clock()` when it changed)."""
        self.past: dict[str, CheckedReport] = {}
        """report key -> the last report of an incarnation no longer its learner's newest (for goodput; its
        fragments' books are not kept)."""
        self.events: list[LearnerEvent] = []
        self._live_prev: set[str] = set()
        self.ignored: Counter[str] = Counter()
        """Report fields dropped as unusable, by field (`ddiloco.protocol.reports`)."""
        self.on_ignored: Callable[[str], None] = lambda field: None
        self._warned: set[tuple[str, str]] = set()
        self._counted: dict[str, Any] = {}  # contributor -> seq of the report last counted
        self._fastest: dict[str, float] = {}
        self._first_heard: dict[str, float] = {}
        self.proven: set[int] = set()
        """Learner ids with a merged answer: once there are any, pacing reads only their cadences (a learner
        pod can sign reports for ids that never answer; they cannot move the median)."""

    def state_dict(self) -> dict[str, Any]:
        """The learners' joins and losses so far (`ddiloco.stateful.Stateful`)."""
        return {"learner_events": list(self.events)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.events = list(state["learner_events"])

    def refresh(self) -> None:
        """Re-read the learners' reports and record who joined or was lost."""
        newest: dict[int, str] = {}
        found = [
            k for k in self.store.list(keys.LEARNERS) if keys.is_report_key(k) and k.split("/")[1].isdigit()
        ]
        for key in found:
            lid = int(key.split("/")[1])
            newest[lid] = max(newest.get(lid, key), key)
        for key in set(found) - set(newest.values()) - set(self.past):
            self._read_past(key, int(key.split("/")[1]))
        for lid, key in newest.items():
            report = self._read(key, lid)
            if report is not None:
                self.reports[lid] = report
                mark = (int(report.incarnation), report.seq or 0)
                if lid not in self.heard or self.heard[lid][0] != mark:
                    self.heard[lid] = (mark, self.clock())
        live = self.live_names()
        now = self.wall()
        self.events += [LearnerEvent("joined", c, now) for c in sorted(live - self._live_prev)]
        self.events += [LearnerEvent("lost", c, now) for c in sorted(self._live_prev - live)]
        self._live_prev = live

    def _read(self, key: str, lid: int) -> CheckedReport | None:
        """A learner report that reads and validates, checked once, else None (logged)."""
        try:
            report = self.store.get_json(key)
        except StoreError as e:
            log.debug("report %s unreadable (%s)", key, e)
            return None
        problem = signing.check_doc(report, self.keys, signing.LEARNER)
        if problem is not None:
            reason = problem.split(":", 1)[0]
            if (key, reason) not in self._warned:
                self._warned.add((key, reason))
                self.on_ignored(f"report_{reason}")
                log.warning("syncer: ignoring learner report %s: %s", key, problem)
            return None
        if not validation.report_ok(report, lid) or not reports.times_finite(report):
            log.warning("syncer: ignoring malformed learner report %s", key)
            return None
        cleaned, dropped = reports.clean(report)
        checked = CheckedReport.of(cleaned)
        who, seq = keys.contributor(lid, checked.incarnation), checked.seq
        new = self._counted.get(who, -1) != seq  # an unchanged report is re-read, not counted again
        self._counted[who] = seq
        for field in dropped:
            if new:
                self.ignored[field.rsplit(".", 1)[-1]] += 1
                self.on_ignored(field.rsplit(".", 1)[-1])
            if (who, field) not in self._warned:
                self._warned.add((who, field))
                log.warning("syncer: ignoring %s of learner %s's report: not a usable number", field, who)
        if (t := checked.cadence) is not None:
            self._fastest[who] = min(t, self._fastest.get(who, t))
        self._first_heard.setdefault(who, self.clock())
        return checked

    def _read_past(self, key: str, lid: int) -> None:
        """Once, when an incarnation is superseded (or found so at start): its books for goodput."""
        report = self._read(key, lid)
        if report is not None:
            self.past[key] = dataclasses.replace(report, discarded_tokens={})

    def live(self) -> list[CheckedReport]:
        """Reports of the learners whose report changed recently and is not final (module docstring)."""
        now = self.clock()
        return [
            r
            for lid, r in self.reports.items()
            if not r.final and lid in self.heard and now - self.heard[lid][1] < self.timeout_s
        ]

    def live_names(self) -> set[str]:
        """Contributor names of the live learner incarnations."""
        return {keys.contributor(r.learner_id, r.incarnation) for r in self.live()}

    def measured_step(self) -> float | None:
        """Median wall seconds per step of the live learners with a merged answer, loop overhead included
        (`chiptime.cadence`); until one has merged, the fastest live learner's (rounds then open early
        rather than late: reports of ids that never answer cannot hold the first merge back); None until
        one reported its cadence."""
        live = self.live()
        proven = [t for r in live if r.learner_id in self.proven and (t := r.cadence)]
        if proven:
            return statistics.median(proven)
        times = [t for r in live if (t := r.cadence)]
        return min(times) if times else None

    def pace(self, steady: Callable[[float], float] = lambda t: t) -> Pace:
        """What the claim bounds read (`ddiloco.protocol.claims.Pace`) of the live incarnations: the fastest
        cadence each reported, and when this syncer first heard of it (`steady`: the syncer's clock to the
        steady wall time the bounds use)."""
        live = self.live_names()
        by_learner: dict[str, float] = {}  # a new incarnation inherits its learner's fastest cadence
        for c, t in self._fastest.items():
            lid = c.split("-")[0]
            by_learner[lid] = min(t, by_learner.get(lid, t))
        own = {c: self._fastest.get(c, by_learner.get(c.split("-")[0])) for c in live}
        own = {c: t for c, t in own.items() if t is not None}
        return Pace(own, {c: steady(t) for c, t in self._first_heard.items() if c in live})

    def mean_loss(self) -> float:
        """Mean loss EMA of the live learners; NaN when none reported one."""
        losses = [r.loss_ema for r in self.live() if r.loss_ema is not None]
        return statistics.mean(losses) if losses else math.nan

    def throughput(self) -> dict[str, float | None]:
        """The status' `tokens_per_s` (processed tokens per second of the live learners together) and `mfu`
        (model FLOP/s over peak FLOP/s, summed over the live learners that know their peak); None where no
        live learner says."""
        live = self.live()
        rates = [r.tokens_per_s for r in live if r.tokens_per_s is not None]
        known = [(r.mfu * r.peak_flops, r.peak_flops) for r in live if r.mfu is not None and r.peak_flops]
        peak = sum(p for _, p in known)
        return {
            "tokens_per_s": sum(rates) if rates else None,
            "mfu": sum(f for f, _ in known) / peak if peak else None,
        }

    def tokens_processed(self) -> int:
        """Tokens every incarnation of every learner processed, merged or not."""
        return sum(r.tokens_processed or 0 for r in [*self.reports.values(), *self.past.values()])

    def tokens_discarded(self) -> float:
        """Tokens the learners report discarded, summed over fragments (the caller averages)."""
        return sum(n for r in self.reports.values() for n in r.discarded_tokens.values())

    def goodput(self) -> float:
        """The paper's goodput up to now (`ddiloco.protocol.chiptime`). A live learner's books end at its newest
        report; a dead one's are extended by the time since its report last changed, on this syncer's clock
        (never by comparing this host's clock with the learner's)."""
        reports, past, heard = dict(self.reports), list(self.past.values()), dict(self.heard)
        live = {r.learner_id for r in self.live()}  # copies: a scrape runs on another thread
        now, per_learner = self.clock(), []
        for lid, newest in reports.items():
            incs = [newest, *(r for r in past if r.learner_id == lid)]
            down = 0.0 if lid in live or lid not in heard else now - heard[lid][1]
            per_learner.append(chiptime.learner_chip_time(incs, newest.time + down))
        return chiptime.goodput(per_learner) or 0.0
