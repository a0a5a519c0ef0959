"""The round lifecycle: one owner opens, collects, merges, commits, closes and abandons every round.

Design choices:
- One object owns the rounds in flight, like torchft's one owner per fragment with its commit gate
  (`torchft/local_sgd.py`): the open rounds, the merges waiting for the publisher, the pacing of openings and
  the run's closing (`ddiloco.syncer.drain`). The syncer (`ddiloco.syncer.loop`) hands it its parts and the
  few things it asks of the syncer back: write the status, save the state, track a merge, the pacing figures.
- Every round opens through `_open` and closes through `close` (merged, abandoned, or open at the finish).
- A merge's publish runs on the publisher's thread (`ddiloco.syncer.publisher`) and is committed here in the
  order it was handed over: the fragment adopts the proposal, the ledger and books are credited, the pace is
  measured, then the status and the state are written, the round's updates deleted and old versions pruned.
- What a publish raised decides the rest: an older epoch's version (`Superseded`, `ddiloco.syncer.adopt`)
  is adopted and the round abandoned; a store error keeps the proposal to publish again; anything else ends
  the loop.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from collections.abc import Callable, Iterable
from functools import partial

from ddiloco import keys
from ddiloco.config.run import RunConfig
from ddiloco.platform import failpoints
from ddiloco.protocol import wire
from ddiloco.protocol.messages import RoundRecord
from ddiloco.store.base import NotFound, Store, StoreError
from ddiloco.syncer.adopt import Superseded
from ddiloco.syncer.commit import adopt_superseding, credit_merge, measure_pace, observe_merge
from ddiloco.syncer.drain import Closing, wait_s
from ddiloco.syncer.fragment import GlobalFragment, MergeRule, merged_tokens
from ddiloco.syncer.intake import Intake
from ddiloco.syncer.lease import Lease
from ddiloco.syncer.pace import Pace
from ddiloco.syncer.publisher import InFlight, Pending, Publisher
from ddiloco.syncer.retention import Retention
from ddiloco.syncer.roster import Roster
from ddiloco.syncer.rounds import DEFAULT_EMA, OpenRule, QuorumRule, Round, Verdict, decide, ema, link_time
from ddiloco.syncer.state import Books, SyncerFiles
from ddiloco.tracking.metrics import SyncerMetrics

log = logging.getLogger(__name__)


class RoundLifecycle:
    """The syncer's rounds from opening to their commit or abandon (module docstring)."""

    def __init__(
        self,
        cfg: RunConfig,
        *,
        store: Store,
        files: SyncerFiles,
        fragments: list[GlobalFragment],
        books: Books,
        rule: MergeRule,
        roster: Roster,
        intake: Intake,
        publisher: Publisher,
        lease: Lease,
        retention: Retention,
        metrics: SyncerMetrics,
        pace: Pace,
        clock: Callable[[], float],
        wall: Callable[[], float],
        steady_of: Callable[[float], float],
        threads: int,
        open_rounds: dict[int, Round],
        publish_status: Callable[[], None],
        save_state: Callable[[], None],
        on_merged: Callable[[RoundRecord, float], None],
        xi_step: Callable[[], float],
        grace_window: Callable[[], float],
    ) -> None:
        """`fragments` and `books` are the syncer's (shared, changed in place); `open_rounds`: the rounds a
        restart resumes collecting. The callables are the syncer's: `on_merged(record, seconds)` tracks a
        committed merge, `xi_step` and `grace_window` are its pacing figures now."""
        self.cfg, self.store, self.files, self.fragments, self.books = cfg, store, files, fragments, books
        self.rule, self.roster, self.intake, self.publisher = rule, roster, intake, publisher
        self.lease, self.retention, self.metrics, self.pace = lease, retention, metrics, pace
        self.clock, self.wall, self.steady_of, self.threads = clock, wall, steady_of, threads
        self.publish_status, self.save_state, self.on_merged = publish_status, save_state, on_merged
        self.xi_step, self.grace_window = xi_step, grace_window
        d = cfg.diloco
        self.open_rule, self.quorum_rule = OpenRule.of(d, len(fragments)), QuorumRule.of(d)
        self.ema_alpha = d.grace.ema if d.grace is not None else DEFAULT_EMA
        self.open = open_rounds
        """Round -> the round, open until it is committed or abandoned."""
        self.unpublished: dict[int, Pending] = {}
        """Round -> a merge not handed to the publisher yet (it was busy) or whose publish failed: published
        (again) as it is, never merged twice."""
        self.last_open = -math.inf
        self.opened_clock: dict[int, float] = {}
        """Fragment -> the syncer's clock when its last round opened (`diloco.sync_from: open`)."""
        self.closing: Closing | None = None
        """Set once the budget is reached or the deadline passed: the run's last rounds (`ddiloco.syncer.drain`)."""
        self.uncleaned: defaultdict[int, set[int]] = defaultdict(set)
        """Fragment -> merged rounds whose updates the cleaner has not deleted yet (after a restart: every
        recent merge, as nobody knows): what is under them is the merged answers, neither late nor replays."""
        for m in books.merged_recent:
            self.uncleaned[m.fragment_id].add(m.round)

    # --- opening ----------------------------------------------------------------------------------------------
    def _open(self, p: int, now: float) -> Round:
        """Open the next round, on fragment `p`, and say so in the status."""
        b = self.books
        rnd = self.open[b.next_round] = Round(b.next_round, p, now, self.wall())
        b.next_round += 1
        self.publish_status()
        return rnd

    def maybe_open(self, now: float) -> None:
        """Open the next round in round-robin order if the pacing rule lets it (`rounds.OpenRule`)."""
        p = self.books.next_round % len(self.fragments)
        if not self.roster.live() or not self.open_rule.may_open(
            now,
            fragment=p,
            open_fragments=[r.fragment_id for r in self.open.values()],
            last_open=self.last_open,
            published_clock=self.fragments[p].merged_clock,
            measured_step=self.roster.measured_step(),
            opened_clock=self.opened_clock.get(p, -math.inf),
        ):
            return
        self.opened_clock[p] = self.last_open = now
        self._open(p, now)

    def open_due(self, now: float) -> str | None:
        """Open what may open now: a round by the pacing rule or, while closing, the closing rounds. Returns
        why the run ends once its closing finished, else None."""
        if self.closing is None:
            self.maybe_open(now)
            return None
        c, d = self.closing, self.cfg.diloco
        if c.finished(
            self.clock(), open_rounds=self.open, unpublished=self.unpublished, timeout_s=d.round_timeout_s
        ):
            return c.reason
        for p in c.take(len(self.open), d.overlap, live=bool(self.roster.live())):
            c.rounds.add(self._open(p, now).round)
        return None

    # --- closing the run --------------------------------------------------------------------------------------
    def begin_closing(self, reason: str, now: float) -> None:
        """Close the run and say so in the status, so learners stop stepping (`ddiloco.syncer.drain`)."""
        self.closing = Closing.begin(
            reason,
            now,
            next_round=self.books.next_round,
            num_fragments=len(self.fragments),
            busy={r.fragment_id for r in self.open.values()},
            merged=merged_tokens(self.fragments),
        )
        self.publish_status()  # after `closing` is set: this status says `closing`

    def merges_to_the_mean(self) -> bool:
        """Whether the round merged now is its fragment's last move and goes to the learners' weighted mean
        (`propose(final=True)`): the run is closing and `diloco.closing_step` is `mean` (`ddiloco.syncer.drain`)."""
        return self.closing is not None and self.cfg.diloco.closing_step == "mean"

    # --- collecting and deciding ------------------------------------------------------------------------------
    def advance(self) -> None:
        """Collect and decide every open round (one a commit earlier in this pass closed is passed over)."""
        for rnd in list(self.open.values()):
            if rnd.round in self.open:
                self.progress(rnd, self.clock())

    def progress(self, rnd: Round, now: float) -> None:
        if self.publisher.holds(rnd.round):  # being published: committed by `commit_published`
            return
        if rnd.round in self.unpublished:  # merged, waiting for the publisher or to be published again
            self.merge(rnd, now)
            return
        self.intake.collect(rnd)
        wait = wait_s(self.cfg, self.books.xi_link) if self.closing is not None else 0.0
        if self.closing is not None and self.closing.is_short_and_due(rnd, now, wait):
            if rnd.answers:  # below the quorum K: abandoned
                self.abandon(rnd)
            else:  # nobody had steps on its fragment
                self.close(rnd)
                self.publish_status()
            return
        verdict = decide(rnd, self.roster.live_names(), now, self.quorum_rule)
        if verdict is Verdict.QUORUM:
            rnd.quorum_at = now
            self.books.xi_quorum = ema(self.books.xi_quorum, now - rnd.opened_at, self.ema_alpha)
            rnd.grace_s = max(self.grace_window(), wait)  # while closing: wait for stopped learners
        elif verdict is Verdict.ABANDON:
            self.abandon(rnd)
        elif verdict is Verdict.MERGE:
            self.merge(rnd, now)

    # --- merging and committing -------------------------------------------------------------------------------
    def merge(self, rnd: Round, now: float) -> None:
        """Merge a round's answers into a proposal and hand its publish to the publisher; `commit_published`
        closes the round once it is persisted. Waits (the round stays open) while the publisher holds as many
        merges as it may."""
        if rnd.round not in self.unpublished:
            if self.publisher.busy():
                return
            frag, m0 = self.fragments[rnd.fragment_id], self.clock()
            try:
                reread, merged = partial(self.intake.reread, rnd), merged_tokens(self.fragments)
                final = self.merges_to_the_mean()  # the run is closing: the fragment's last move
                proposal = frag.propose(
                    rnd.answers, self.rule, rnd.sums, reread, tokens_merged=merged, final=final
                )
            except (wire.PayloadError, NotFound) as e:  # a second read found other bytes, or none
                log.error(
                    "syncer: round %d (fragment %d) cannot be merged: %s", rnd.round, rnd.fragment_id, e
                )
                self.abandon(rnd)
                return
            if rnd.sums is not None:  # the proposal holds what the round's sums were for
                rnd.sums.release()
                rnd.sums = None
            record = proposal.record(rnd, now=now, merged_at=self.wall())
            record.epoch = self.lease.epoch
            published_at = self.steady_of(self.clock())  # before the write: no learner holds it earlier
            self.unpublished[rnd.round] = Pending(proposal, record, published_at, now, self.clock() - m0)
        if self.publisher.busy():
            return
        self.lease.check(publish_s=self.books.xi_sync)
        self.publisher.submit(rnd, self.unpublished.pop(rnd.round))
        if not self.publisher.beside or all(
            self.publisher.holds(r) for r in self.open
        ):  # nothing to do meanwhile
            self.commit_published(wait=True)

    def commit_published(self, wait: bool = False) -> None:
        """The commit gate: close the rounds whose publish returned, in order; `wait`: all of them. A store
        error is raised once every finished publish was looked at (its proposal is kept)."""
        failed: StoreError | None = None
        for done in self.publisher.finished(wait):
            try:
                self._commit(done)
            except StoreError as e:
                failed = e
        if failed is not None:
            raise failed

    def _commit(self, done: InFlight) -> None:
        """Close the round of a publish that returned (module docstring)."""
        rnd, pending = done.rnd, done.pending
        error = done.future.exception()
        if isinstance(error, Superseded):  # its answers were merged against the version before: abandoned
            log.error("syncer: %s; adopting it and abandoning round %d", error, rnd.round)
            adopt_superseding(
                self.files, self.fragments, self.books, self.rule, rnd.fragment_id, self.lease.epoch
            )
            self.abandon(rnd)
            return
        if isinstance(error, StoreError):  # nothing of it counts until its global version is written
            self.unpublished[rnd.round] = pending
            raise error
        if error is not None:
            raise error
        written, publish_s = done.future.result()
        frag, record, books = self.fragments[rnd.fragment_id], pending.record, self.books
        now = self.clock()
        xi = self.xi_step()
        period = (now - frag.merged_clock) / xi if math.isfinite(frag.merged_clock) else None
        overlap = (now - rnd.opened_at) / xi
        if self.closing is not None and rnd.round in self.closing.rounds:  # learners do not step: no pace
            self.closing.merged += 1
        else:
            measure_pace(self.pace, self.metrics, overlap, period, pending.merge_seconds + publish_s)
        credit_merge(frag, books, self.metrics, pending, written, now)
        self.close(rnd, merged=True, contributors=record.contributors.keys())
        self.roster.proven.update(int(c.split("-")[0]) for c in record.contributors)
        books.xi_sync = ema(books.xi_sync, self.clock() - pending.began, self.ema_alpha)
        if (link := link_time(rnd.answers.values())) is not None:
            books.xi_link = ema(books.xi_link, link, self.ema_alpha)
        observe_merge(self.metrics, record, self.clock() - pending.began)
        self.on_merged(record, self.clock() - pending.began)
        self.publish_status()
        failpoints.hit("publish", "after_status")
        self.save_state()
        failpoints.hit("publish", "after_state")
        p, versions, merges = frag.fragment_id, [f.version for f in self.fragments], books.rounds_merged
        store, retention, uncleaned = self.store, self.retention, self.uncleaned[p]
        uncleaned.add(rnd.round)  # the round's own updates are the cleaner's
        self.sweep_late(p)

        def clean() -> None:  # on the cleaner's thread, in commit order
            for r in sorted(uncleaned.copy()):  # this round's, and any a failed cleaning left
                store.delete_prefix(keys.update_prefix(p, r))
                uncleaned.discard(r)
            retention.after_merge(p, versions, merges)

        self.publisher.clean(clean)
        d = self.cfg.diloco
        self.pace.warn_if_behind(d.sync_every, d.overlap, self.threads, now)
        log.debug(
            "syncer: round %d fragment %d -> v%d from %d answers (overlap %.1f steps)",
            rnd.round,
            frag.fragment_id,
            frag.version,
            record.quorum,
            overlap,
        )

    # --- closing rounds ---------------------------------------------------------------------------------------
    def close(self, rnd: Round, merged: bool = False, contributors: Iterable[str] = ()) -> None:
        """Take `rnd` out of the open rounds and give its sums back. One that did not merge (abandoned, or open
        when the run finishes) leaves no round record (one there is what a publish that died left: a learner
        would read it as a merge) and no updates; a merged round's updates are the cleaner's. `contributors`:
        the answers it merged (their steps are credited: `claims.Coverage`)."""
        self.intake.validator.coverage.closed(rnd.round, rnd.fragment_id, contributors)
        if not merged:
            self.store.delete(keys.round_record_key(rnd.round))
            self.store.delete_prefix(keys.update_prefix(rnd.fragment_id, rnd.round))
        del self.open[rnd.round]
        if rnd.sums is not None:
            rnd.sums.release()
            rnd.sums = None

    def abandon(self, rnd: Round) -> None:
        """Close `rnd` without a merge (no quorum in time, a merge that could not read its answers, a closing
        round short of its quorum): counted, logged, and the learners told through the status."""
        self.close(rnd)
        log.warning(
            "syncer: round %d (fragment %d) abandoned: %d of %d answers",
            rnd.round,
            rnd.fragment_id,
            len(rnd.answers),
            self.quorum_rule.quorum,
        )
        self.books.rounds_abandoned += 1
        self.metrics.rounds.labels(outcome="abandoned").inc()
        self.publish_status()

    def close_all(self) -> None:
        """The run finishes: every open round closes unmerged and the merges not published are dropped."""
        for rnd in list(self.open.values()):
            self.close(rnd)
        self.unpublished.clear()

    def sweep_late(self, p: int) -> None:
        """Sweep late answers of fragment p's closed rounds, leaving the open ones and the merged ones the
        cleaner has not reached yet to their owners (under load the cleaner runs rounds behind the loop)."""
        open_rounds = {r.round for r in self.open.values() if r.fragment_id == p} | self.uncleaned[p].copy()
        merged = {m.round: m.contributors.keys() for m in self.books.merged_recent if m.fragment_id == p}
        self.intake.sweep_late(p, open_rounds, merged)
