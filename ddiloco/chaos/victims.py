"""Victims found through the store: what the pid and pod backends share.

Design choices:
- Learner i's process (or pod) is named by its newest report (`host`, `pid`), the syncer's by
  `syncer/status.json` (`syncer_host`, `syncer_pid`). A name read from the store is never trusted alone: each
  backend checks the victim again on its own side (the pod's labels, the process's command line) before it
  kills, and returns None when the check fails (the runner then waits, and records a skip in the end).
- These backends fire only timed kills; stalls and added learners are not possible on a cluster.
"""

from __future__ import annotations

import logging

from ddiloco import keys
from ddiloco.chaos.runner import Outcome
from ddiloco.config.chaos_schedule import ChaosEvent
from ddiloco.protocol.learner_report import LearnerReport
from ddiloco.protocol.messages import Status
from ddiloco.store.base import Store

log = logging.getLogger(__name__)

TIMED_KILLS = frozenset({"kill_learner", "kill_syncer"})
CANNOT_ON_A_CLUSTER = {
    "stall_learner": "skipped (not possible on Kubernetes: pods cannot be paused)",
    "add_learner": "skipped (not possible on Kubernetes: the pipeline starts its learners)",
}


def newest_report(store: Store, learner_id: int) -> LearnerReport | None:
    """The newest incarnation's report of a learner (keys are zero-padded, so the largest key is newest);
    None when it has none. A report that does not read is a ValueError naming the field."""
    found = [k for k in store.list(keys.learner_prefix(learner_id)) if keys.is_report_key(k)]
    doc = store.get_json_or_none(max(found)) if found else None
    return None if doc is None else LearnerReport.from_json(doc)


def victim_of(store: Store, ev: ChaosEvent) -> tuple[str, int | None] | None:
    """(host, pid) of the process an event targets, from the store; None when it has not reported yet, or
    what it reported does not read (logged)."""
    try:
        if ev.kind == "kill_syncer":
            doc = store.get_json_or_none(keys.STATUS)
            status = None if doc is None else Status.from_json(doc)
            return (status.syncer_host, status.syncer_pid) if status and status.syncer_host else None
        report = newest_report(store, ev.learner) if ev.learner is not None else None
    except ValueError as e:
        log.warning("chaos: no victim for %s yet: %s", ev.id, e)
        return None
    if report is None or not report.host or report.final:
        return None  # not started, or its newest incarnation already exited
    return report.host, report.pid


class ReportedVictims:
    """A backend that kills the victim the store names; subclasses say how (`kill`)."""

    name = ""
    persist = True
    fires = TIMED_KILLS
    cannot = CANNOT_ON_A_CLUSTER

    def fire(self, ev: ChaosEvent, store: Store) -> Outcome | None:
        victim = victim_of(store, ev)
        return None if victim is None else self.kill(ev.role(), *victim)

    def kill(self, role: str, host: str, pid: int | None) -> Outcome | None:
        """Kill the victim; None if it is not (or not yet) a target we may kill."""
        raise NotImplementedError
