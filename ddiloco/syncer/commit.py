"""Closing a merged round once its publish returned (every round closes through `close_round`), and the
state the syncer saves, asked of its stateful parts (`ddiloco.stateful`).

Design choices:
- The loop commits publishes in the order they were handed to the publisher (`ddiloco.syncer.publisher`),
  on its own thread: the fragment adopts the proposal, the ledger and books are credited, the pace is
  measured (`ddiloco.syncer.pace`), then the status and the state are written, the round's updates deleted
  and old versions pruned: the order a merge always had after its publish.
- The functions take the loop's `ddiloco.syncer.loop.Syncer` (typed `Any`: that module imports this one).
- What the publish raised decides the rest: an older epoch's version (`Superseded`) is adopted and the
  round abandoned; a store error keeps the proposal to publish again; anything else ends the loop.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from typing import Any

from ddiloco import failpoints, keys
from ddiloco.metrics import SyncerMetrics
from ddiloco.protocol.messages import RoundRecord, SyncerState
from ddiloco.stateful import Stateful, gather
from ddiloco.store.base import StoreError
from ddiloco.syncer.adopt import Superseded
from ddiloco.syncer.publisher import InFlight
from ddiloco.syncer.rounds import Round, ema, link_time, open_rounds
from ddiloco.syncer.state import credit

log = logging.getLogger(__name__)


def commit_published(syncer: Any, done: InFlight) -> None:
    """Close the round of a publish that returned (module docstring)."""
    rnd, pending = done.rnd, done.pending
    error = done.future.exception()
    if isinstance(error, Superseded):
        adopt_superseding(syncer, rnd, error)
        return
    if isinstance(error, StoreError):  # nothing of it counts until its global version is written
        syncer.unpublished[rnd.round] = pending
        raise error
    if error is not None:
        raise error
    written, publish_s = done.future.result()
    frag, record = syncer.fragments[rnd.fragment_id], pending.record
    now = syncer.clock()
    xi = syncer.xi_step()
    period = (now - frag.merged_clock) / xi if math.isfinite(frag.merged_clock) else None
    overlap = (now - rnd.opened_at) / xi
    closing = getattr(syncer, "closing", None)
    if closing is not None and rnd.round in closing.rounds:  # learners do not step while closing: no pace
        closing.merged += 1
    else:
        syncer.pace.add(overlap, period, pending.merge_seconds + publish_s)
        syncer.metrics.overlap_steps.observe(overlap)
        if period is not None:
            syncer.metrics.sync_period_steps.observe(period)
    frag.commit(pending.proposal, published_at=pending.published_at, clock=now)
    syncer.books.bytes_published += written
    syncer.metrics.published.inc(written)
    credit(frag.ledger, record)
    syncer.books.account(record)
    for c, f in record.clipped.items():
        log.warning("syncer: round %d: outer gradient of %s clipped by %.3g (robust mode)", rnd.round, c, f)
        syncer.books.clipped["norm_outlier"] += 1
        syncer.metrics.clipped.labels(reason="norm_outlier").inc()
    if (trimmed := pending.proposal.stats.get("trimmed")) is not None:  # a round merged by the trimmed mean
        log.debug(
            "syncer: round %d: trimmed mean, %d of %d answers dropped per side",
            rnd.round,
            trimmed,
            record.quorum,
        )
        syncer.books.clipped["trimmed_mean"] += 1
        syncer.metrics.clipped.labels(reason="trimmed_mean").inc()
    close_round(syncer, rnd, merged=True, contributors=record.contributors.keys())
    syncer.roster.proven.update(int(c.split("-")[0]) for c in record.contributors)
    alpha = syncer.ema_alpha
    syncer.books.xi_sync = ema(syncer.books.xi_sync, syncer.clock() - pending.began, alpha)
    if (link := link_time(rnd.answers.values())) is not None:
        syncer.books.xi_link = ema(syncer.books.xi_link, link, alpha)
    observe_merge(syncer.metrics, record, syncer.clock() - pending.began)
    track_merge(syncer, record, syncer.clock() - pending.began)
    syncer.publish_status()
    failpoints.hit("publish", "after_status")
    syncer.save_state()
    failpoints.hit("publish", "after_state")
    sweep_late(syncer, frag.fragment_id, cleaning=rnd.round)  # the round's own updates are the cleaner's
    p, versions, merges = frag.fragment_id, syncer.versions, syncer.books.rounds_merged

    def clean() -> None:
        syncer.store.delete_prefix(keys.update_prefix(p, rnd.round))
        syncer.retention.after_merge(p, versions, merges)

    syncer.publisher.clean(clean)
    d = syncer.cfg.diloco
    syncer.pace.warn_if_behind(d.sync_every, d.overlap, syncer.threads, now)
    log.debug(
        "syncer: round %d fragment %d -> v%d from %d answers (overlap %.1f steps)",
        rnd.round,
        frag.fragment_id,
        frag.version,
        record.quorum,
        overlap,
    )


def close_round(syncer: Any, rnd: Round, merged: bool = False, contributors: Iterable[str] = ()) -> None:
    """Take `rnd` out of the open rounds and give its sums back. One that did not merge (abandoned, or open
    when the run finishes) leaves no round record (one there is what a publish that died left: a learner
    would read it as a merge) and no updates; a merged round's updates are the cleaner's. `contributors`:
    the answers it merged (their steps are credited: `claims.Coverage`)."""
    syncer.intake.validator.coverage.closed(rnd.round, rnd.fragment_id, contributors)
    if not merged:
        syncer.store.delete(keys.round_record_key(rnd.round))
        syncer.store.delete_prefix(keys.update_prefix(rnd.fragment_id, rnd.round))
    del syncer.open[rnd.round]
    if rnd.sums is not None:
        rnd.sums.release()
        rnd.sums = None


def abandon_round(syncer: Any, rnd: Round) -> None:
    """Close `rnd` without a merge (no quorum in time, a merge that could not read its answers, a closing
    round short of its quorum): counted, logged, and the learners told through the status."""
    close_round(syncer, rnd)
    log.warning(
        "syncer: round %d (fragment %d) abandoned: %d of %d answers",
        rnd.round,
        rnd.fragment_id,
        len(rnd.answers),
        syncer.quorum_rule.quorum,
    )
    syncer.books.rounds_abandoned += 1
    syncer.metrics.rounds.labels(outcome="abandoned").inc()
    syncer.publish_status()


def state_of(syncer: Any) -> SyncerState:
    """What `Syncer.save_state` writes: the run, the lease epoch, the fragments' versions and ledgers and
    the open rounds, then the fields of each stateful part (`ddiloco.stateful`)."""
    own = {"run_id": syncer.run_id, "epoch": syncer.lease.epoch, "versions": syncer.versions}
    own |= {"ledger": [f.ledger for f in syncer.fragments], "open_rounds": open_rounds(syncer.open.values())}
    return SyncerState(**own, **gather(parts_of(syncer)))


def parts_of(syncer: Any) -> tuple[Stateful, ...]:
    """The syncer's parts whose fields the saved state holds: the books of rounds, the intake's counts, the
    roster's learner events, the quarantine."""
    return (syncer.books, syncer.intake, syncer.roster, syncer.files.slots)


def adopt_superseding(syncer: Any, rnd: Round, e: Superseded) -> None:
    """An older epoch published the version this round was to become (`ddiloco.syncer.adopt`): adopt it
    and what follows it, and abandon the round (its answers were merged against the version before)."""
    p, frag = rnd.fragment_id, syncer.fragments[rnd.fragment_id]
    log.error("syncer: %s; adopting it and abandoning round %d", e, rnd.round)
    version, adopted = syncer.files.slots.adopt_after(p, frag.version, syncer.lease.epoch)
    for rec in adopted:
        credit(frag.ledger, rec)
        syncer.books.account(rec)
        syncer.books.next_round = max(syncer.books.next_round, rec.round + 1)
    syncer.fragments[p] = syncer.files.load_fragment(p, version, frag.ledger, syncer.rule)
    syncer._abandon(rnd)


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


def track_merge(syncer: Any, record: RoundRecord, seconds: float) -> None:
    """What the syncer logs for experiment tracking at each merge (`ddiloco.tracking`: its TensorBoard run
    `tb/syncer/` and the MLflow run), at step = tokens merged: the run's progress and the learners' mean
    loss (`global/`), the round (`round/`: quorum, staleness of its answers, grace, time to quorum, merge and
    publish seconds, outer-gradient norm) and the books (`syncer/`). Only queued: never waits."""
    if not syncer.tracker.enabled:
        return
    state = syncer.metrics_state()
    stale = [c.staleness for c in record.contributors.values()]
    values = {
        "global/tokens_merged": state["tokens_merged"],
        "global/versions_published": sum(state["versions"]),
        "global/learner_loss_mean": syncer.roster.mean_loss(),
        "round/quorum": record.quorum,
        "round/staleness_mean": sum(stale) / len(stale) if stale else None,
        "round/staleness_max": max(stale, default=None),
        "round/grace_seconds": record.grace_s,
        "round/time_to_quorum_seconds": record.time_to_quorum,
        "round/merge_seconds": seconds,
        "round/outer_grad_norm": record.merged_norm,
        "syncer/rounds_merged": syncer.books.rounds_merged,
        "syncer/rounds_abandoned": syncer.books.rounds_abandoned,
        "syncer/bytes_published": syncer.books.bytes_published,
        "syncer/live_learners": state["live_learners"],
        "syncer/goodput": state["goodput"],
        "syncer/merged_token_share": state["merged_token_share"],
        "syncer/tokens_discarded": state["tokens_discarded"],
    }
    syncer.tracker.scalars(values, state["tokens_merged"])


def sweep_late(syncer: Any, p: int, cleaning: int | None = None) -> None:
    """Sweep late answers of fragment p's closed rounds; `cleaning`: a round whose updates the cleaner
    deletes (left alone here: its merged answers are not late)."""
    open_rounds = {r.round for r in syncer.open.values() if r.fragment_id == p}
    if cleaning is not None:
        open_rounds.add(cleaning)
    merged = {m.round: m.contributors.keys() for m in syncer.books.merged_recent if m.fragment_id == p}
    syncer.intake.sweep_late(p, open_rounds, merged)
