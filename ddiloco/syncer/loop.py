"""The syncer: a CPU-only loop that opens rounds, collects learner answers, merges and publishes fragments.

Rounds go round-robin over fragments, one every (H/P)·ξ_step seconds, at most τ in flight, and a fragment's
no sooner than H·ξ_step after its last version (ξ_step: the live learners' median wall seconds per step).
Answers are validated as they arrive (`ddiloco.syncer.intake`) and added to their round's running sums; when
a round merges or is abandoned is decided by `ddiloco.syncer.rounds`, and `ddiloco.syncer.lifecycle` owns
each round until its commit. A merge's publish runs on the publisher's thread (`ddiloco.syncer.publisher`)
while the loop goes on; its writes follow a fixed order that a restart adopts from (`ddiloco.syncer.state`).
At the budget the syncer closes the run (`ddiloco.syncer.drain`) and writes the final model. It publishes
only while it holds the lease's newest epoch (`ddiloco.syncer.lease`); `Fenced` ends `run_until_done`, and
`ddiloco syncer` exits with `FENCED_EXIT`.

Design notes (pacing, trust, persist order, store errors): docs/internals.md, "The syncer's loop".
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable

import torch
from prometheus_client import CollectorRegistry

from ddiloco import keys
from ddiloco.config.run import RunConfig
from ddiloco.platform.hostname import host_name
from ddiloco.protocol.messages import Done, RoundRecord, Status, SyncerState
from ddiloco.run.root import RunRoot
from ddiloco.run.schedule import learner_train
from ddiloco.stateful import Stateful, gather, restore
from ddiloco.store.base import Store, StoreError
from ddiloco.syncer.commit import track_merge
from ddiloco.syncer.fragment import MergeRule, merged_tokens
from ddiloco.syncer.intake import Intake, UpdateValidator, split_threads
from ddiloco.syncer.lease import Lease
from ddiloco.syncer.lifecycle import RoundLifecycle
from ddiloco.syncer.pace import Pace
from ddiloco.syncer.publisher import Publisher
from ddiloco.syncer.retention import Retention
from ddiloco.syncer.roster import Roster
from ddiloco.syncer.rounds import DEFAULT_STEP_S, GraceRule, Round, grace_window, open_rounds
from ddiloco.syncer.state import Resumed, SyncerFiles
from ddiloco.tracking.metrics import SyncerMetrics
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
    @classmethod
    def open(
        cls,
        store: Store,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        poll_s: float = 0.02,
        registry: CollectorRegistry | None = None,
        secret: bytes | None = None,
        robust_clip: float | None = None,
        threads: int | None = None,
        lease: Lease | None = None,
        publish_beside: bool = True,
    ) -> Syncer:
        """The syncer of the run at `store`, resumed from what the store holds: the config, the layout, the
        saved state and any version published after it, the pace, the retention record and the base times
        of recent merges. `secret`: the master key from DDILOCO_RUN_KEY (None: unsigned). `robust_clip`:
        robust mode factor; default `cfg.diloco.robust_clip` when the config has it. `lease`: held
        (`Lease.acquire`) before the syncer resumes from the store; None seizes the next epoch at once and
        renews it from `step` (in-process use). `publish_beside`: publishes run beside the loop (False: each
        merge waits for its publish, so an in-process run driven pass by pass is deterministic)."""
        steady_of = steady(wall, clock)
        cfg = RunRoot.read_config(store)
        d = cfg.diloco
        lease = lease if lease is not None else Lease.seized(store, cfg.run_id, cfg.lease)
        root = RunRoot.keyed(store, cfg.run_id, secret, role="syncer")
        layout = root.layout()
        if threads is not None:  # the merge's passes use those the intake's readers leave (None: as it is)
            torch.set_num_threads(split_threads(threads)[1])
        rule = MergeRule.of(d, layout, robust_clip, learner_train(cfg))
        files = SyncerFiles(root, layout, d.global_dtype, d.download_codec)
        resumed = files.resume(rule, wall(), lease.epoch)
        open_ = {  # resume collecting; answers are re-read from the store
            r.round: Round(r.round, r.fragment_id, clock(), r.opened_wall) for r in resumed.open_rounds
        }
        pace = Pace.from_json(store.get_json_or_none(keys.SYNCER_PACE, max_bytes=1 << 16), since=clock())
        retention = Retention(store, cfg.retention, layout.num_fragments)  # pruned after each merge
        run_start = root.prepared_at()
        deadline = None if d.deadline_s is None else (run_start or wall()) + d.deadline_s
        kw = {"signer": root.signer, "retained": retention.keeps, "run_start": run_start}
        validator = UpdateValidator(cfg, layout, resumed.fragments, wall=lambda: steady_of(clock()), **kw)
        validator.learn_base_times(store, resumed.books.merged_recent)
        syncer = cls(
            store,
            cfg=cfg,
            root=root,
            lease=lease,
            files=files,
            rule=rule,
            resumed=resumed,
            open_rounds=open_,
            publisher=Publisher(files, beside=publish_beside),
            pace=pace,
            retention=retention,
            validator=validator,
            registry=registry if registry is not None else CollectorRegistry(),
            deadline=deadline,
            clock=clock,
            wall=wall,
            steady_of=steady_of,
            poll_s=poll_s,
            threads=threads or 1,
        )
        if resumed.state is not None:  # `resume` restored the books, fragments and quarantine
            restore((syncer.roster, syncer.intake), resumed.state)
        return syncer

    def __init__(
        self,
        store: Store,
        *,
        cfg: RunConfig,
        root: RunRoot,
        lease: Lease,
        files: SyncerFiles,
        rule: MergeRule,
        resumed: Resumed,
        open_rounds: dict[int, Round],
        publisher: Publisher,
        pace: Pace,
        retention: Retention,
        validator: UpdateValidator,
        registry: CollectorRegistry,
        deadline: float | None,
        clock: Callable[[], float],
        wall: Callable[[], float],
        steady_of: Callable[[float], float],
        poll_s: float,
        threads: int,
    ) -> None:
        """The syncer's parts as `open` read them from the store; the ones that call back into the syncer
        (metrics, roster, intake, the round owner) are wired here, without store I/O."""
        self.store, self.clock, self.wall, self.poll_s, self.steady_of = store, clock, wall, poll_s, steady_of
        self.cfg, self.run_id, self.root, self.lease = cfg, cfg.run_id, root, lease
        self.files, self.layout, self.P, self.threads = (
            files,
            files.layout,
            files.layout.num_fragments,
            threads,
        )
        self.rule, self.grace_rule = rule, GraceRule.of(cfg.diloco)
        self.books, self.fragments = resumed.books, resumed.fragments
        self.publisher, self.pace, self.retention, self.deadline = publisher, pace, retention, deadline
        self._next_refresh = 0.0
        self._status_due = -math.inf
        hb = cfg.train.heartbeat_every_s
        self.roster = Roster(store, clock=clock, wall=wall, heartbeat_s=hb, keys_=root.key)
        self.registry = registry
        self.metrics = SyncerMetrics(registry, self.metrics_state)
        self.tracker: Tracker = OFF  # `ddiloco syncer` sets the role's (`track_merge`)
        self.roster.on_ignored = lambda f: self.metrics.report_fields_ignored.labels(field=f).inc()
        self.intake = Intake(
            store,
            validator,
            self.metrics,
            clock=clock,
            wall=wall,
            on_notice=self.publish_status,
            accept=lambda rnd, ans: self.fragments[rnd.fragment_id].accept(rnd, ans, self.rule),
            threads=threads,
        )
        self.rounds = RoundLifecycle(
            cfg,
            store=store,
            files=files,
            fragments=self.fragments,
            books=self.books,
            rule=rule,
            roster=self.roster,
            intake=self.intake,
            publisher=publisher,
            lease=lease,
            retention=retention,
            metrics=self.metrics,
            pace=pace,
            clock=clock,
            wall=wall,
            steady_of=steady_of,
            threads=threads,
            open_rounds=open_rounds,
            publish_status=self.publish_status,
            save_state=self.save_state,
            on_merged=self.track_merge,
            xi_step=self.xi_step,
            grace_window=self.grace_window,
        )
        """Every round from its opening to its commit or abandon (`ddiloco.syncer.lifecycle`)."""

    # --- books ------------------------------------------------------------------------------------------------
    @property
    def versions(self) -> list[int]:
        return [f.version for f in self.fragments]

    def tokens_merged(self) -> float:
        return merged_tokens(self.fragments)

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

    def track_merge(self, record: RoundRecord, seconds: float) -> None:
        """Log a committed merge for experiment tracking (`ddiloco.syncer.commit.track_merge`), if tracked."""
        if self.tracker.enabled:
            state = self.metrics_state()
            track_merge(self.tracker, state, self.roster.mean_loss(), self.books, record, seconds)

    def publish_status(self, done: bool = False) -> None:
        """Write the signed status (again each heartbeat: one a learner pod overwrote is soon replaced)."""
        self._status_due = self.clock() + self.cfg.train.heartbeat_every_s
        b, rounds = self.books, self.rounds
        status = Status(
            run_id=self.run_id,
            time=self.wall(),
            syncer_incarnation=b.incarnation,
            done=done,
            syncer_host=host_name(),
            syncer_pid=os.getpid(),
            next_round=b.next_round,
            versions=self.versions,
            open_rounds=open_rounds(rounds.open.values()),
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
            closing=rounds.closing is not None,
            **self.roster.throughput(),
        )
        self.lease.raise_if_fenced()
        self.files.put_status(status)

    def stateful_parts(self) -> tuple[Stateful, ...]:
        """The parts whose fields the saved state holds: the books of rounds, the intake's counts, the
        roster's learner events, the quarantine (`ddiloco.stateful`)."""
        return (self.books, self.intake, self.roster, self.files.slots)

    def save_state(self) -> None:
        """Write the state: the run, the lease epoch, the fragments' versions and ledgers and the open rounds,
        then the fields of each stateful part; and the pace."""
        own = {"run_id": self.run_id, "epoch": self.lease.epoch, "versions": self.versions}
        own |= {
            "ledger": [f.ledger for f in self.fragments],
            "open_rounds": open_rounds(self.rounds.open.values()),
        }
        state = SyncerState(**own, **gather(self.stateful_parts()))
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
        self.rounds.commit_published()
        if now >= self._status_due:
            self.publish_status()
        if self.rounds.closing is None and (reason := finished_by(self)):
            self.rounds.begin_closing(reason, now)
        if (ended := self.rounds.open_due(now)) is not None:
            self.finish(ended)
            return True
        self.rounds.advance()
        return False

    def finish(self, reason: str = "budget") -> None:
        self.rounds.commit_published(wait=True)  # what is being published is part of the final model
        self.publisher.wait_clean()
        self.lease.check(publish_s=self.books.xi_sync)
        self.rounds.close_all()
        self.store.delete_prefix(keys.UPDATES)
        self.files.write_final(self.fragments, self.tokens_merged())
        self.save_state()
        done = Done(self.wall(), self.tokens_merged(), reason, self.books.rounds_merged)
        if self.rounds.closing is not None:
            done.closing = self.rounds.closing.figures(self.clock(), self.tokens_merged())
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
