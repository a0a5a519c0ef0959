"""The syncer: a CPU-only loop that opens rounds, collects learner answers, merges and publishes fragments.

Design choices:
- Syncer-clocked rounds go round-robin over fragments (p = s mod P). A round opens every (H/P)·ξ_step
  seconds, at most τ rounds in flight, never two for the same fragment, and a fragment's round no sooner than
  H·ξ_step after its previous version was published, so an answer covers about H learner steps (the merge's
  latency is not taken out of them). ξ_step is the median of the live learners' *wall* seconds per step, the
  loop's overhead included, each measured on the learner's own clock (`ddiloco.chiptime`): compute time alone
  would open rounds faster than every H/P real steps.
- When a round has its quorum, waits out its grace window, merges or is abandoned is decided by
  `ddiloco.syncer.rounds` (pure); this loop applies the verdicts.
- Answers are parsed and validated as they arrive (`ddiloco.syncer.intake`; every rule and reason is listed in
  `ddiloco.protocol.validation`) and added to their round's running sums at once (`ddiloco.accumulate`), so
  an open round holds two fragment-sized buffers whatever the number of answers, and a merge finalises the
  sums and takes the outer step (`GlobalFragment.propose`, the outer optimizer of `ddiloco.merge`). A merge
  that must read an answer again (robust clipping, a single answer) and finds other bytes or none abandons
  the round. A rejected object never touches the global model; it is counted by reason
  (state, metrics, summary), and the learner it authentically came from is told through a bounded
  `rejections` list in the status object.
- A signature proves only that an update comes from a learner of the run (every learner pod holds the run
  key): what it claims is bounded by the config and this syncer's clocks (`ddiloco.protocol.claims`), and
  the numbers of the unsigned learner reports are checked before they steer pacing
  (`ddiloco.protocol.reports`).
- With the run key every update must carry a valid signature, and everything the syncer publishes (global
  versions, outer momentum, the final model) is signed.
- Robust mode (`robust_clip`) clips outer gradients above robust_clip × the round's median norm; clipped
  answers are still merged and counted under `clipped` (state, status, metrics, round record).
- Rounds of different fragments are in flight at once: a merge's publish runs on the publisher's thread
  (`ddiloco.syncer.publisher`) while this loop collects and merges other rounds, and is committed here
  once it returned (`ddiloco.syncer.commit`); a round stays open until then. Persist order per merge:
  outer momentum → fp32 master (bf16 globals, download deltas) → round record → download delta → global
  payload + latest pointer → status → state; a restart adopts what a crash left between them
  (`ddiloco.syncer.state`, `ddiloco.syncer.adopt`). A store error inside a publish leaves the round open
  with its proposal and record kept: a later pass publishes exactly those again (no second outer step),
  and the writes that landed are recognised as its own. A version an older epoch published meanwhile
  (`Superseded`) is adopted and the round abandoned. Then the round's updates are deleted and the
  fragment's old versions pruned (`ddiloco.syncer.retention`) on the cleaner's thread. The steps of a
  publish are failpoints (`ddiloco.failpoints`). How closely the rounds keep H and τ is measured per
  merge (`ddiloco.syncer.pace`: overlap, sync period, `syncer_lag`).
- The end of a run: when the budget is reached (or the deadline passed) the syncer closes it, every
  fragment gets one last round on what the learners trained since its last merge and the learners stop
  stepping (`ddiloco.syncer.drain`); then it writes the final model.
- An abandoned round (and one still open when the run finishes) has no round record: a record there is
  what a publish that died before its global version left, and is deleted before the status says the round
  closed, so no learner reads it as a merge (its ledger would credit tokens the syncer never merged).
- One publishing syncer at a time (`ddiloco.syncer.lease`): the syncer publishes only while it holds the
  lease's newest epoch, checks it before each merge is persisted (and the renewal thread's finding before
  every status and state write), and names its epoch in everything it publishes. `Fenced` is not caught
  here: it ends `run_until_done`, and `ddiloco syncer` exits with `FENCED_EXIT`.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from functools import partial

import torch
from prometheus_client import CollectorRegistry

from ddiloco import keys
from ddiloco.hostname import host_name
from ddiloco.metrics import SyncerMetrics
from ddiloco.protocol import wire
from ddiloco.protocol.messages import Done, Status
from ddiloco.run import RunRoot
from ddiloco.schedule import learner_train
from ddiloco.stateful import restore
from ddiloco.store.base import NotFound, Store, StoreError
from ddiloco.syncer.commit import abandon_round, close_round, commit_published, state_of
from ddiloco.syncer.drain import Closing, merges_to_the_mean
from ddiloco.syncer.fragment import MergeRule
from ddiloco.syncer.intake import Intake, UpdateValidator, split_threads
from ddiloco.syncer.lease import Lease
from ddiloco.syncer.pace import Pace
from ddiloco.syncer.publisher import Pending, Publisher
from ddiloco.syncer.retention import Retention
from ddiloco.syncer.roster import Roster
from ddiloco.syncer.rounds import (
    DEFAULT_EMA,
    DEFAULT_STEP_S,
    GraceRule,
    OpenRule,
    QuorumRule,
    Round,
    Verdict,
    decide,
    ema,
    grace_window,
    open_rounds,
)
from ddiloco.syncer.state import SyncerFiles
from ddiloco.tracking.tracker import OFF, Tracker

log = logging.getLogger(__name__)


def syncer_threads() -> int:
    """OMP_NUM_THREADS when set (the local launcher sets it for every process), else the CPUs this process
    may use (its affinity: a container's CPU set), at most 8."""
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env)
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, min(8, cpus))


class Syncer:
    def __init__(
        self,
        store: Store,
        *,
        clock=time.monotonic,
        wall=time.time,
        poll_s: float = 0.02,
        registry: CollectorRegistry | None = None,
        secret: bytes | None = None,
        robust_clip: float | None = None,
        threads: int | None = None,
        lease: Lease | None = None,
        publish_beside: bool = True,
    ) -> None:
        """`secret`: the master key from DDILOCO_RUN_KEY (None: unsigned). `robust_clip`: robust mode
        factor; default `cfg.diloco.robust_clip` when the config has it. `lease`: held (`Lease.acquire`)
        before the syncer resumes from the store; None seizes the next epoch at once and renews it from
        `step` (in-process use). `publish_beside`: publishes run beside the loop (False: each merge waits for
        its publish, so an in-process run driven pass by pass is deterministic)."""
        self.store, self.clock, self.wall, self.poll_s = store, clock, wall, poll_s
        self.steady_of = steady(wall, clock)
        self.cfg = cfg = RunRoot.read_config(store)
        self.run_id, d = cfg.run_id, cfg.diloco
        self.lease = lease if lease is not None else Lease.seized(store, self.run_id, cfg.lease)
        self.root = RunRoot.keyed(store, self.run_id, secret, role="syncer")
        self.layout = self.root.layout()
        self.P = self.layout.num_fragments
        self.threads = threads or 1
        if threads is not None:  # the merge's passes use those the intake's readers leave (None: as it is)
            torch.set_num_threads(split_threads(threads)[1])
        self.rule = MergeRule.of(d, self.layout, robust_clip, learner_train(cfg))
        self.quorum_rule = QuorumRule.of(d)
        self.grace_rule = GraceRule.of(d)
        self.open_rule = OpenRule.of(d, self.P)
        self.ema_alpha = d.grace.ema if d.grace is not None else DEFAULT_EMA
        self.files = SyncerFiles(self.root, self.layout, d.global_dtype, d.download_codec)
        resumed = self.files.resume(self.rule, wall(), self.lease.epoch)
        self.books, self.fragments = resumed.books, resumed.fragments
        self.open: dict[int, Round] = {  # resume collecting; answers are re-read from the store
            r.round: Round(r.round, r.fragment_id, clock(), r.opened_wall) for r in resumed.open_rounds
        }
        self.unpublished: dict[int, Pending] = {}
        """Round -> a merge not handed to the publisher yet (it was busy) or whose publish failed: published
        (again) as it is, never merged twice."""
        self.publisher = Publisher(self.files, beside=publish_beside)
        self.pace = Pace.from_json(store.get_json_or_none(keys.SYNCER_PACE, max_bytes=1 << 16), since=clock())
        self.last_open = -math.inf
        self.opened_clock: dict[int, float] = {}
        """Fragment -> the syncer's clock when its last round opened (`diloco.sync_from: open`)."""
        self._next_refresh = 0.0
        self._status_due = -math.inf
        self.closing: Closing | None = None
        """Set once the budget is reached or the deadline passed: the run's last rounds (`ddiloco.syncer.drain`)."""
        hb = cfg.train.heartbeat_every_s
        self.roster = Roster(store, clock=clock, wall=wall, heartbeat_s=hb, keys_=self.root.key)
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = SyncerMetrics(self.registry, self.metrics_state)
        self.tracker: Tracker = OFF  # `ddiloco syncer` sets the role's (`ddiloco.syncer.commit.track_merge`)
        self.retention = Retention(store, cfg.retention, self.P)  # bounded storage, pruned after each merge
        self.roster.on_ignored = lambda f: self.metrics.report_fields_ignored.labels(field=f).inc()
        run_start = self.root.prepared_at()
        self.deadline = None if d.deadline_s is None else (run_start or wall()) + d.deadline_s
        kw = {
            "signer": self.root.signer,
            "wall": lambda: self.steady_of(clock()),
            "retained": self.retention.keeps,
            "run_start": run_start,
        }
        validator = UpdateValidator(cfg, self.layout, self.fragments, **kw)
        validator.learn_base_times(store, self.books.merged_recent)
        self.intake = Intake(
            store,
            validator,
            self.metrics,
            clock=clock,
            wall=wall,
            on_notice=self.publish_status,
            accept=lambda rnd, ans: self.fragments[rnd.fragment_id].accept(rnd, ans, self.rule),
            threads=self.threads,
        )
        if resumed.state is not None:  # `resume` restored the books, fragments and quarantine
            restore((self.roster, self.intake), resumed.state)

    # --- books ------------------------------------------------------------------------------------------------
    @property
    def versions(self) -> list[int]:
        return [f.version for f in self.fragments]

    def tokens_merged(self) -> float:
        return sum(f.ledger.merged_tokens for f in self.fragments) / self.P

    def metrics_state(self) -> dict[str, object]:
        """What the metrics collector exports at scrape time, derived from the syncer's own books."""
        processed = self.roster.tokens_processed()
        return {
            "tokens_merged": self.tokens_merged(),
            "tokens_discarded": self.roster.tokens_discarded() / self.P,
            "token_budget": self.cfg.diloco.token_budget,
            "live_learners": len(self.roster.live()),
            "goodput": self.roster.goodput(),
            "merged_token_share": min(self.tokens_merged() / processed, 1.0) if processed else 0.0,
            "syncer_lag": self.pace_figures()["syncer_lag"],
            "versions": self.versions,
            "quarantined": dict(self.files.slots.quarantined),
        }

    def publish_status(self, done: bool = False) -> None:
        """Write the signed status (again each heartbeat: one a learner pod overwrote is soon replaced)."""
        self._status_due = self.clock() + self.cfg.train.heartbeat_every_s
        b = self.books
        status = Status(
            run_id=self.run_id,
            time=self.wall(),
            syncer_incarnation=b.incarnation,
            done=done,
            syncer_host=host_name(),
            syncer_pid=os.getpid(),
            next_round=b.next_round,
            versions=self.versions,
            open_rounds=open_rounds(self.open.values()),
            merged=list(b.merged_recent),
            tokens_merged=self.tokens_merged(),
            token_budget=self.cfg.diloco.token_budget,
            rounds_merged=b.rounds_merged,
            live_learners=len(self.roster.live()),
            loss=self.roster.mean_loss(),
            rejected=dict(self.intake.rejected),
            clipped=dict(b.clipped),
            rejections=list(self.intake.notices),
            epoch=self.lease.epoch,
            standbys=self.lease.standbys(),
            closing=self.closing is not None,
            **self.roster.throughput(),
        )
        self.lease.raise_if_fenced()
        self.files.put_status(status)

    def save_state(self) -> None:
        state = state_of(self)
        self.lease.raise_if_fenced()
        self.files.save_state(state)
        self.store.put_json(keys.SYNCER_PACE, self.pace.to_json(self.pace_figures()))

    def pace_figures(self) -> dict[str, object]:
        d = self.cfg.diloco
        return self.pace.figures(d.sync_every, d.overlap, self.threads, self.clock())

    # --- pacing -----------------------------------------------------------------------------------------------
    def xi_step(self) -> float:
        """Median wall seconds per step of the live learners, loop overhead included (`chiptime.cadence`)."""
        return self.roster.measured_step() or DEFAULT_STEP_S

    def grace_window(self) -> float:
        """The grace window after a quorum, from the timings known now (`rounds.grace_window`)."""
        b = self.books
        return grace_window(self.grace_rule, self.xi_step(), b.xi_quorum, b.xi_sync, b.xi_link)

    # --- rounds -----------------------------------------------------------------------------------------------
    def maybe_open_round(self, now: float) -> None:
        b, p = self.books, self.books.next_round % self.P
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
        self.open[b.next_round] = Round(b.next_round, p, now, self.wall())
        self.opened_clock[p] = now
        b.next_round += 1
        self.last_open = now
        self.publish_status()

    def progress(self, rnd: Round, now: float) -> None:
        if self.publisher.holds(rnd.round):  # being published: committed by `commit_published`
            return
        if rnd.round in self.unpublished:  # merged, waiting for the publisher or to be published again
            self.merge(rnd, now)
            return
        self.intake.collect(rnd)
        wait = self.closing.wait_s(self) if self.closing is not None else 0.0
        if self.closing is not None and self.closing.settle_short(self, rnd, now, wait):
            return
        verdict = decide(rnd, self.roster.live_names(), now, self.quorum_rule)
        if verdict is Verdict.QUORUM:
            rnd.quorum_at = now
            self.books.xi_quorum = ema(self.books.xi_quorum, now - rnd.opened_at, self.ema_alpha)
            rnd.grace_s = max(self.grace_window(), wait)  # while closing: wait for stopped learners
        elif verdict is Verdict.ABANDON:
            self._abandon(rnd)
        elif verdict is Verdict.MERGE:
            self.merge(rnd, now)

    def _abandon(self, rnd: Round) -> None:
        abandon_round(self, rnd)  # `ddiloco.syncer.commit`; every abandon goes through here

    def merge(self, rnd: Round, now: float) -> None:
        """Merge a round's answers into a proposal and hand its publish to the publisher
        (`ddiloco.syncer.publisher`); `commit_published` closes the round once it is persisted. Waits (the
        round stays open) while the publisher holds as many merges as it may."""
        if rnd.round not in self.unpublished:
            if self.publisher.busy():
                return
            frag, m0 = self.fragments[rnd.fragment_id], self.clock()
            try:
                reread, merged = partial(self.intake.reread, rnd), self.tokens_merged()
                final = merges_to_the_mean(self)  # the run is closing: the fragment's last move
                proposal = frag.propose(
                    rnd.answers, self.rule, rnd.sums, reread, tokens_merged=merged, final=final
                )
            except (wire.PayloadError, NotFound) as e:  # a second read found other bytes, or none
                log.error(
                    "syncer: round %d (fragment %d) cannot be merged: %s", rnd.round, rnd.fragment_id, e
                )
                self._abandon(rnd)
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
        """Close the rounds whose publish returned, in order (`ddiloco.syncer.commit`); `wait`: all of them.
        A store error is raised once every finished publish was looked at (its proposal is kept)."""
        failed: StoreError | None = None
        for done in self.publisher.finished(wait):
            try:
                commit_published(self, done)
            except StoreError as e:
                failed = e
        if failed is not None:
            raise failed

    # --- the loop ---------------------------------------------------------------------------------------------
    def step(self) -> bool:
        """One pass of the loop; returns True when the run is finished."""
        self.lease.renew_if_due()
        now = self.clock()
        if now >= self._next_refresh:
            self.roster.refresh()
            self.intake.validator.pace = self.roster.pace(self.steady_of)  # a snapshot readers may share
            # Until a learner reported its cadence no round opens (`rounds.OpenRule`): look again soon.
            measured = self.roster.measured_step() is not None
            self._next_refresh = now + (min(0.5, self.cfg.train.heartbeat_every_s) if measured else 0.05)
        self.commit_published()
        if now >= self._status_due:
            self.publish_status()
        if self.closing is None and (reason := finished_by(self)):
            Closing.begin(self, reason, now)  # sets self.closing
        if self.closing is None:
            self.maybe_open_round(now)
        elif self.closing.step(self, now):
            self.finish(self.closing.reason)
            return True
        for rnd in list(self.open.values()):
            if rnd.round in self.open:  # not closed by a commit earlier in this pass
                self.progress(rnd, self.clock())
        return False

    def finish(self, reason: str = "budget") -> None:
        self.commit_published(wait=True)  # what is being published is part of the final model
        self.publisher.wait_clean()
        self.lease.check(publish_s=self.books.xi_sync)
        for rnd in list(self.open.values()):
            close_round(self, rnd)
        self.unpublished.clear()
        self.store.delete_prefix(keys.UPDATES)
        self.files.write_final(self.fragments, self.tokens_merged())
        self.save_state()
        done = Done(self.wall(), self.tokens_merged(), reason, self.books.rounds_merged)
        if self.closing is not None:
            done.closing = self.closing.figures(self, self.clock())
        self.root.write_signed_document(keys.DONE, done.to_json())
        self.publish_status(done=True)
        self.lease.release()
        log.info(
            "syncer: done (%s) — %d tokens merged in %d rounds; versions %s",
            reason,
            self.tokens_merged(),
            self.books.rounds_merged,
            self.versions,
        )


def steady(wall: Callable[[], float], clock: Callable[[], float]) -> Callable[[float], float]:
    """The syncer's clock as a wall time that never steps (what the claim bounds measure ages with: a step
    of the host's wall clock moves no bound)."""
    wall0, clock0 = wall(), clock()
    return lambda t: wall0 + (t - clock0)


def finished_by(syncer: Syncer) -> str | None:
    """Why the run is over (`budget`: enough tokens merged; `deadline`: diloco.deadline_s passed), or None."""
    if syncer.tokens_merged() >= syncer.cfg.diloco.token_budget:
        return "budget"
    return "deadline" if syncer.deadline is not None and syncer.wall() >= syncer.deadline else None


def run_until_done(syncer: Syncer, max_seconds: float | None = None) -> None:
    """The syncer process's loop: passes of `Syncer.step` until the run is done (or `max_seconds`), riding out
    store errors (nothing half-merged was published; the pass is tried again) and logging progress."""
    if syncer.root.is_done():
        log.info("syncer: run %s is already done", syncer.run_id)
        return
    syncer.publish_status()
    syncer.save_state()
    deadline = None if max_seconds is None else syncer.clock() + max_seconds
    last_log = syncer.clock()
    while True:
        try:
            if syncer.step():
                return
        except StoreError as e:  # unreachable store: nothing half-merged was published; try again
            log.warning("syncer: store error (%s); retrying", e)
            time.sleep(1.0)
        if deadline is not None and syncer.clock() > deadline:
            log.warning(
                "syncer: stopping after max_seconds=%s without reaching the token budget", max_seconds
            )
            return
        if syncer.clock() - last_log > 10:
            last_log = syncer.clock()
            log.info(
                "syncer: %d/%d tokens merged, %d rounds, %d live learners",
                syncer.tokens_merged(),
                syncer.cfg.diloco.token_budget,
                syncer.books.rounds_merged,
                len(syncer.roster.live()),
            )
        syncer.publisher.wait_any(syncer.poll_s)  # a publish that lands is committed at once
