"""What committing a published round records: the fragment's new version, the ledger and books, the pace it
kept, what robust mode clipped, the merge's metrics and its experiment-tracking values; and the adoption of
a version an older epoch published instead.

Design choices:
- Called by the round owner (`ddiloco.syncer.lifecycle`) once a publish returned, on the loop's thread, with
  exactly the parts each needs: the books, the metrics, the pace, the tracker.
- Closing rounds are left out of the pace (`ddiloco.syncer.drain`): learners do not step while closing.
- Tracking only queues its values (`ddiloco.tracking`): a commit never waits on it.
"""

from __future__ import annotations

import logging
from typing import Any

from ddiloco.protocol.messages import RoundRecord
from ddiloco.syncer.fragment import GlobalFragment, MergeRule
from ddiloco.syncer.pace import Pace
from ddiloco.syncer.publisher import Pending
from ddiloco.syncer.state import Books, SyncerFiles, credit
from ddiloco.tracking.metrics import SyncerMetrics
from ddiloco.tracking.tracker import Tracker

log = logging.getLogger(__name__)


def measure_pace(
    pace: Pace, metrics: SyncerMetrics, overlap: float, period: float | None, busy_seconds: float
) -> None:
    """One merge's overlap and sync period in learner steps, and the seconds merging and publishing it
    took (`ddiloco.syncer.pace`)."""
    pace.add(overlap, period, busy_seconds)
    metrics.overlap_steps.observe(overlap)
    if period is not None:
        metrics.sync_period_steps.observe(period)


def credit_merge(
    frag: GlobalFragment, books: Books, metrics: SyncerMetrics, pending: Pending, written: int, now: float
) -> None:
    """The fragment adopts a persisted proposal (`now`: the syncer's clock); its ledger and the books are
    credited with the round, the `written` bytes, and what robust mode did: outer gradients clipped by
    norm, a trimmed mean (counted and logged)."""
    record, proposal = pending.record, pending.proposal
    frag.commit(proposal, published_at=pending.published_at, clock=now)
    books.bytes_published += written
    metrics.published.inc(written)
    credit(frag.ledger, record)
    books.account(record)
    for c, f in record.clipped.items():
        log.warning(
            "syncer: round %d: outer gradient of %s clipped by %.3g (robust mode)", record.round, c, f
        )
        books.clipped["norm_outlier"] += 1
        metrics.clipped.labels(reason="norm_outlier").inc()
    if (trimmed := proposal.stats.get("trimmed")) is not None:  # a round merged by the trimmed mean
        log.debug(
            "syncer: round %d: trimmed mean, %d of %d answers dropped per side",
            record.round,
            trimmed,
            record.quorum,
        )
        books.clipped["trimmed_mean"] += 1
        metrics.clipped.labels(reason="trimmed_mean").inc()


def adopt_superseding(
    files: SyncerFiles, fragments: list[GlobalFragment], books: Books, rule: MergeRule, p: int, epoch: int
) -> None:
    """An older epoch published the version fragment p's round was to become (`ddiloco.syncer.adopt`):
    adopt it and what follows it (ledger, books, the next round number) and reload the fragment."""
    frag = fragments[p]
    version, adopted = files.slots.adopt_after(p, frag.version, epoch)
    for rec in adopted:
        credit(frag.ledger, rec)
        books.account(rec)
        books.next_round = max(books.next_round, rec.round + 1)
    fragments[p] = files.load_fragment(p, version, frag.ledger, rule)


def observe_merge(m: SyncerMetrics, record: RoundRecord, seconds: float) -> None:
    """The metrics of one merged round; `seconds`: how long merging and publishing it took."""
    p = str(record.fragment_id)
    m.rounds.labels(outcome="merged").inc()
    m.merges.labels(fragment=p).inc()
    m.quorum.observe(record.quorum)
    m.grace.observe(record.grace_s)
    m.time_to_quorum.observe(record.time_to_quorum)
    m.merge_seconds.observe(seconds)
    for c in record.contributors.values():
        m.staleness.observe(c.staleness)
    m.outer_grad_norm.labels(fragment=p).set(record.merged_norm)


def track_merge(
    tracker: Tracker, state: dict[str, Any], loss: float, books: Books, record: RoundRecord, seconds: float
) -> None:
    """What the syncer logs for experiment tracking at each merge (`ddiloco.tracking`: its TensorBoard run
    `tb/syncer/` and the MLflow run), at step = tokens merged: the run's progress and the learners' mean
    loss (`global/`), the round (`round/`: quorum, staleness of its answers, grace, time to quorum, merge and
    publish seconds, outer-gradient norm) and the books (`syncer/`). `state`: the syncer's metrics state
    (`Syncer.metrics_state`), `loss`: the live learners' mean loss. Only queued: never waits."""
    stale = [c.staleness for c in record.contributors.values()]
    values = {
        "global/tokens_merged": state["tokens_merged"],
        "global/versions_published": sum(state["versions"]),
        "global/learner_loss_mean": loss,
        "round/quorum": record.quorum,
        "round/staleness_mean": sum(stale) / len(stale) if stale else None,
        "round/staleness_max": max(stale, default=None),
        "round/grace_seconds": record.grace_s,
        "round/time_to_quorum_seconds": record.time_to_quorum,
        "round/merge_seconds": seconds,
        "round/outer_grad_norm": record.merged_norm,
        "syncer/rounds_merged": books.rounds_merged,
        "syncer/rounds_abandoned": books.rounds_abandoned,
        "syncer/bytes_published": books.bytes_published,
        "syncer/live_learners": state["live_learners"],
        "syncer/goodput": state["goodput"],
        "syncer/merged_token_share": state["merged_token_share"],
        "syncer/tokens_discarded": state["tokens_discarded"],
    }
    tracker.scalars(values, state["tokens_merged"])
