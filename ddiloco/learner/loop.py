"""A learner: inner AdamW steps on its own shard, answering the syncer's rounds without ever waiting for it.

The training loop never blocks on the store: a poller thread keeps the latest status, uploads, downloads,
reports and checkpoints run on a small thread pool, and at a step boundary the main thread only applies
finished downloads, snapshots deltas for open rounds and schedules I/O. `Exchange` is the protocol with the
syncer, `FragmentLedger` the token books (processed = merged + discarded + outstanding, per fragment),
`IoSchedule` the cadence of heartbeats and checkpoints; the `Learner` holds the model and runs start, tick,
step and finish. A report is written before each upload, so the syncer never merges tokens the reports do
not mention. A learner starts from the current globals, never from a random init, and once the syncer
closes the run it only answers and applies versions until done.

Design notes (health, trust, devices, efficiency): docs/internals.md, "The training loop".
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from prometheus_client import CollectorRegistry

from ddiloco import keys
from ddiloco.chaos.inprocess import LearnerChaos
from ddiloco.config.chaos_schedule import schedule_from_config
from ddiloco.config.run import RunConfig
from ddiloco.data.loader import ShardLoader
from ddiloco.data.shards import Assignment, assign_shard
from ddiloco.data.streamed import open_loader, read_corpus_doc
from ddiloco.data.tokens.mixture import MixtureLoader
from ddiloco.data.tokens.stream import StreamLoader
from ddiloco.errors import ConfigError
from ddiloco.learner.accel import (
    HostCopier,
    maybe_compile,
    resolve_precision,
    to_device,
    train_step,
)
from ddiloco.learner.checkpoint import checkpoint_every_s, restore_learner
from ddiloco.learner.ddp import Group, lead_handshake_loader, rank_seed
from ddiloco.learner.efficiency import Efficiency
from ddiloco.learner.exchange import Exchange
from ddiloco.learner.health import Heartbeats, IoErrors, MergeBound
from ddiloco.learner.io import (
    CheckpointWriter,
    IoSchedule,
    ReportWriter,
    StatusPoller,
    next_incarnation,
    sample_history,
    snapshot_checkpoint,
)
from ddiloco.learner.ledger import FragmentLedger
from ddiloco.learner.resume import resume_from_reports
from ddiloco.learner.sharded import LiveMembers, ShardedMembers
from ddiloco.learner.tracked import track_report, track_step
from ddiloco.learner.trainer_status import TrainerStatus
from ddiloco.learner.versions import VersionFeed
from ddiloco.model.gpt import configure_optimizer
from ddiloco.platform.devices import resolve_device
from ddiloco.platform.hostname import host_name
from ddiloco.platform.procinfo import peak_rss_bytes
from ddiloco.protocol.chiptime import StepCadence
from ddiloco.protocol.learner_report import LearnerReport
from ddiloco.protocol.messages import Status
from ddiloco.run.globalmodel import Layout, build_model
from ddiloco.run.root import RunRoot, prepared_at_of
from ddiloco.run.schedule import GlobalSchedule, learner_train
from ddiloco.store.base import Store, StoreError
from ddiloco.store.retry import until_store_answers
from ddiloco.tracking.metrics import LearnerMetrics
from ddiloco.tracking.tracker import OFF, Tracker

__all__ = ["Learner", "Opened"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Opened:
    """What `Learner.open` read from the run root and claimed there: everything the constructor needs from
    the store. `root`: the run root, with the run key; `tokens`: the learner's shard (which one: `shard`);
    `prepared_at`: when the run was prepared (chaos' clock)."""

    cfg: RunConfig
    layout: Layout
    root: RunRoot
    shard: Assignment
    tokens: torch.Tensor | None
    prepared_at: float
    started_at: float
    incarnation: int
    corpus: dict[str, Any] | None = None

    @classmethod
    def read(cls, store: Store, learner_id: int, secret: bytes | None, group: Group | None) -> Opened:
        """The store I/O of a learner's start, the incarnation claim last: a failed read claims nothing."""
        cfg = RunRoot.read_config(store)
        root = RunRoot.keyed(store, cfg.run_id, secret, role=f"learner {learner_id}")
        _check_ranks(cfg, group)
        layout = root.layout()
        meta = store.get_json(keys.DATA_META)
        shard = assign_shard(learner_id, meta["shard_tokens"])  # warns when the id has no shard of its own
        tokens, corpus = None, None
        if meta.get("streamed"):  # a pre-tokenized corpus read in place (`ddiloco.data.streamed`)
            corpus = read_corpus_doc(store)
        else:
            span = shard.end - shard.start
            tokens = root.shard(shard.shard, max_tokens=span)
        prepared_at = prepared_at_of(meta) or time.time()
        started_at = time.time()
        incarnation = next_incarnation(store, learner_id, started_at)
        return cls(cfg, layout, root, shard, tokens, prepared_at, started_at, incarnation, corpus)

    def loader(
        self, *, batch_size: int, seq_len: int, seed: int
    ) -> ShardLoader | StreamLoader | MixtureLoader:
        """This learner's batches: from its shard in memory, or streamed from its slot of the corpus."""
        if self.corpus is not None:
            return open_loader(
                self.corpus, self.shard.shard, batch_size=batch_size, seq_len=seq_len, seed=seed
            )
        assert self.tokens is not None
        return ShardLoader(self.tokens, batch_size=batch_size, seq_len=seq_len, seed=seed)


def _check_ranks(cfg: RunConfig, group: Group | None) -> None:
    if group is not None and group.world_size > cfg.train.ranks:
        raise ConfigError(
            f"learner runs {group.world_size} ranks but train.ranks={cfg.train.ranks}; raise it"
        )


class Learner:
    @classmethod
    def open(
        cls,
        store: Store,
        learner_id: int,
        *,
        device: str | None = None,
        threads: int | None = None,
        registry: CollectorRegistry | None = None,
        secret: bytes | None = None,
        site: str = "local",
        group: Group | None = None,
    ) -> Learner:
        """Read the run (`Opened.read`: config, layout, this learner's shard; claims an incarnation), then build
        the learner. `secret`: the master key from DDILOCO_RUN_KEY (None: neither sign nor verify)."""
        opened = Opened.read(store, learner_id, secret, group)
        kwargs = {"device": device, "threads": threads, "registry": registry, "site": site, "group": group}
        return cls(store, learner_id, opened, **kwargs)

    def __init__(
        self,
        store: Store,
        learner_id: int,
        opened: Opened,
        *,
        device: str | None = None,
        threads: int | None = None,
        registry: CollectorRegistry | None = None,
        site: str = "local",
        group: Group | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`site`: where it runs; `group`: the learner's data-parallel ranks when this is rank 0 of several
        (`ddiloco.learner.ddp`); `clock`: the merge bound's (`ddiloco.learner.health.MergeBound`)."""
        cfg, t = opened.cfg, opened.cfg.train
        _check_ranks(cfg, group)
        self.store, self.site, self.learner_id, self.cfg = store, site, learner_id, cfg
        self.root, self.run_id, self.layout = opened.root, cfg.run_id, opened.layout
        self.started_at, self.incarnation = opened.started_at, opened.incarnation
        self.shard = opened.shard  # which data it reads: every report says so
        self.group, self.world_size = group, 1 if group is None else group.world_size
        self.device = resolve_device(device or t.device) if group is None else group.device
        self.precision = resolve_precision(t.precision, self.device) if group is None else group.configure(t)
        if self.device.type == "cpu":
            torch.set_num_threads(threads or t.threads)
        events = schedule_from_config(cfg.chaos, cfg.diloco.learners)
        self.chaos = LearnerChaos(store, events, learner_id, opened.prepared_at, cfg.seed)
        seed = rank_seed(cfg.seed * 1000 + learner_id, 0)
        batch, seq_len = t.batch_for(learner_id), cfg.model.seq_len
        self.loader = opened.loader(batch_size=batch, seq_len=seq_len, seed=seed)
        self._corpus = opened.corpus  # a streamed corpus's document: DDP ranks open their share of it
        self.model = build_model(self.layout, cfg.seed, device=self.device)
        self.opt = configure_optimizer(self.model, t.lr, t.weight_decay, (t.beta1, t.beta2))  # fused on CUDA
        self.net = maybe_compile(self.model, t.compile) if group is None else self.model  # DDP: `_join_ranks`
        self.params = self.layout.members(dict(self.model.named_parameters()))  # by fragment member
        sharded = group is not None and group.sharded  # FSDP2: anchors and gathered fragments on the host
        self.copier = HostCopier(torch.device("cpu") if sharded else self.device)  # answers, checkpoints
        self._defer_loss = self.device.type == "cuda"  # read each loss a step late: the host never waits
        self._loss_in_flight: torch.Tensor | None = None
        self.inner_step = 0
        self.cursor: dict | None = None  # the data cursor after the last step (single process: reported)
        self._started_epochs: float | None = None  # where this incarnation began reading
        self.schedule = GlobalSchedule(
            learner_train(cfg), cfg.diloco.token_budget
        )  # LR on the run's progress
        self.loss: float | None = None
        self.loss_ema: float | None = None
        self.step_time_ema: float | None = None
        self.history: list[list[float]] = []  # [wall time, inner_step, tokens_processed, loss_ema], bounded
        self.cadence = StepCadence()  # wall seconds per step with the loop's overhead: what pacing needs
        self.seq = 0
        self.joined_at: float | None = None
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = LearnerMetrics(self.registry, learner_id, self.incarnation, site)
        self.tracker: Tracker = OFF  # `ddiloco learner` sets the role's (`ddiloco.learner.tracked`)
        matmul = self.precision if group is None else group.shard_precision  # FSDP casts to bf16 itself
        how = {"precision": matmul, "peak_flops": t.peak_flops, "devices": self.world_size}
        self.efficiency = Efficiency.of(self.metrics, self.model, seq_len, self.device, **how)  # MFU, memory
        self.trainer_status = TrainerStatus.from_env(os.environ)  # a Kubeflow TrainJob's progress, if one
        self.reports = ReportWriter(store, keys.report_key(learner_id, self.incarnation), self.root.key)
        self.errors = IoErrors(self.metrics, learner_id)  # what the I/O threads raise: logged and counted
        self.bound = MergeBound(learner_id, t.max_unmerged_s, cfg.diloco, clock)  # ends it if never merged
        self.checkpoints = CheckpointWriter(self.root, learner_id, self.errors)
        every = checkpoint_every_s(t.checkpoint_every_s, sum(f.numel for f in self.layout.fragments))
        self.io_schedule = IoSchedule(t.heartbeat_every_s, every)  # checkpoint cadence by the state's size
        self._stop = threading.Event()
        self.poller = StatusPoller(store, t.poll_every_s, self._stop, self.root.key)
        self.pool = ThreadPoolExecutor(max_workers=3, thread_name_prefix=f"learner{learner_id}-io")
        self.heartbeats = Heartbeats(self.reports.write, self.errors)  # never behind uploads on the pool
        self.ledger = FragmentLedger(self.layout.num_fragments)
        ident = {"learner_id": learner_id, "errors": self.errors}
        self.feed = VersionFeed(
            self.root, self.layout, LiveMembers(self.params), self.copier, self.metrics, cfg.diloco, **ident
        )
        self.exchange = Exchange(
            store, self.ledger, self.feed, self.reports, self.metrics, self.incarnation, cfg.diloco
        )

    # --- start-up -------------------------------------------------------------------------------------------
    def _join_ranks(self, group: Group) -> None:
        """Hand the run and their slices of the shard to the other ranks, wrap the model in DDP or shard it
        (then the optimizer is built on the shards, and fragments go through collectives). Done here, not
        in `open` (which the CLI retries while the store is unavailable), so the ranks hand-shake once."""
        self.loader = lead_handshake_loader(
            group, self.cfg, self.layout, self.learner_id, self.loader, self._corpus, self.shard.shard
        )
        t = self.cfg.train
        self.net = maybe_compile(group.wrap(self.model), t.compile)
        if group.sharded:
            self.opt = configure_optimizer(self.model, t.lr, t.weight_decay, (t.beta1, t.beta2))
            self.params = {}  # the pre-sharding tensors; fragments move through `ShardedMembers`
            self.feed.members = ShardedMembers(group, self.model, self.copier.device)

    def start(self, wait_timeout: float | None = None) -> None:
        if self.group is not None:
            self._join_ranks(self.group)
        # Every read below is retried through a store outage: a learner that starts inside one waits for it.
        ckpt, versions = until_store_answers(lambda: self._resume(wait_timeout), "learner")
        if self.group is not None:  # every rank starts from rank 0's parameters, AdamW state and cursors
            self.group.lead_start(self.model, self.opt, self.inner_step, (ckpt or {}).get("cursors"))
        until_store_answers(lambda: self.store.exists(keys.STATUS) and self.poller.poll_once(), "learner")
        self.poller.start()
        self.joined_at = time.time()
        self.cadence.begin()
        msg = "learner %d incarnation %d joined run %s at versions %s (device %s)"
        log.info(msg, self.learner_id, self.incarnation, self.run_id, versions, self.device)
        self._put_report()
        self.io_schedule.begin()
        self.bound.begin()

    def _resume(self, wait_timeout: float | None) -> tuple[dict[str, Any] | None, list[int]]:
        """Restore this learner's checkpoint and data cursor and join the newest globals (store reads only:
        safe to repeat); the checkpoint's header and the versions joined."""
        ckpt = restore_learner(
            self.root, self.learner_id, self.model, self.opt, self.loader, group=self.group
        )
        self.inner_step = 0 if ckpt is None else int(ckpt["inner_step"])
        if self.group is None:  # DDP ranks resume from the cursors their checkpoint gathered
            resume_from_reports(self.loader, self.store, self.learner_id, self.incarnation)
        self._started_epochs = self.loader.epochs_read
        return ckpt, self.exchange.join(self.feed.wait_for_latest(wait_timeout))

    # --- reports and checkpoints ------------------------------------------------------------------------------
    def _report(self, final: bool = False, reason: str | None = None) -> LearnerReport:
        self.seq += 1
        return report_of(self, final, reason)

    def _by_source(self) -> dict[str, int] | None:
        """Tokens read from each source of a mixture (`data.sources`), across restarts; else None."""
        return dict(self.loader.tokens_by_source) if isinstance(self.loader, MixtureLoader) else None

    def _put_report(self, final: bool = False, reason: str | None = None) -> None:
        try:
            self.reports.write(self._report(final, reason).to_json())
        except StoreError as e:
            log.warning("learner %d: report not written (%s)", self.learner_id, e)

    def _report_async(self) -> None:
        self.metrics.store_retries.set(self.store.stats.retries)
        self.heartbeats.beat(lambda: self._report().to_json())
        track_report(self)
        self.trainer_status.update(self.poller.latest, self.loss, self.efficiency)

    def _checkpoint_async(self) -> None:
        """Snapshot at this step boundary into host buffers (asynchronous on CUDA); an I/O thread writes it."""
        cursor = self.loader.state_dict()
        meta = {"run_id": self.run_id, "cursor": cursor, "incarnation": self.incarnation}
        if self.group is not None:
            meta["cursors"] = self.group.gather_cursors(cursor)
        snap = snapshot_checkpoint(self.copier, self.model, self.opt, self.group)
        self.checkpoints.submit(self.pool, self.inner_step, snap, meta)

    # --- the loop ---------------------------------------------------------------------------------------------
    def _answer_rounds(self, status: Status) -> None:
        self.exchange.answer_rounds(self.pool, status, self.inner_step, self._report, self.poller.first_seen)

    def step(self) -> float | None:
        """One inner step; returns its loss (on CUDA the previous step's, read once this one is queued, so
        the device never waits for the host; None on the first step)."""
        t0 = time.perf_counter()
        x, y = self.loader.next_batch()
        self.efficiency.waited(time.perf_counter() - t0)
        x, y = to_device(x, self.device), to_device(y, self.device)
        lr, clip = self.schedule.lr(self.inner_step), self.cfg.train.grad_clip
        loss_t = train_step(
            self.net, self.opt, x, y, lr, clip, precision=self.precision, before_update=self.copier.fence
        )
        if self._defer_loss:
            loss_t, self._loss_in_flight = self._loss_in_flight, loss_t
        loss = None if loss_t is None else float(loss_t)
        try:
            self.chaos.after_step(self.inner_step + 1, time.perf_counter() - t0)
        except StoreError as e:
            log.warning("chaos hook skipped this step (%s)", e)
        dt = time.perf_counter() - t0
        if loss is not None and not math.isfinite(loss):
            raise FloatingPointError(
                f"learner {self.learner_id}: loss is {loss} at inner step {self.inner_step}; lower train.lr"
            )
        self._count_step(x.numel() * self.world_size, dt, loss)
        if self.group is None:
            self.cursor = self.loader.state_dict()  # reports carry it: a restart resumes after this batch
        return loss

    def _count_step(self, n: int, dt: float, loss: float | None) -> None:
        """Books, moving averages and metrics of one step of `n` tokens (all ranks) in `dt` seconds."""
        self.inner_step += 1
        self.ledger.stepped(n, dt)
        self.step_time_ema = dt if self.step_time_ema is None else 0.9 * self.step_time_ema + 0.1 * dt
        self.cadence.step_done(dt)
        m = self.metrics
        m.inner_steps.inc()
        m.tokens.inc(n)
        self.efficiency.stepped(n, dt, self.cadence.ema or self.step_time_ema)
        m.learning_rate.set(self.schedule.last_lr or 0.0)
        if loss is not None:
            self.loss = loss
            self.loss_ema = loss if self.loss_ema is None else 0.9 * self.loss_ema + 0.1 * loss
            m.loss.set(loss)
        track_step(self, n, loss)

    def tick(self) -> bool:
        """One iteration of the loop at a step boundary; False once the syncer says the run is done."""
        status = self.poller.latest
        merged = self.schedule.observe(status)  # read once: all ranks of this learner step at this progress
        if status is not None:
            if status.done:
                return False
            self.exchange.sync(self.pool, status)
            self._answer_rounds(status)
        own = sum(b.merged_tokens for b in self.ledger)  # `Unmerged` past the bound:
        self.bound.check(status, own, self.errors.store_errors + self.poller.errors, self.cadence.ema)
        if status is not None and status.closing:
            self._idle()
            return True
        if self.group is not None:  # the other ranks step too, after receiving the fragments overwritten here
            self.group.lead_step(self.inner_step, self.exchange.overwritten, self.layout, self.params, merged)
        self.exchange.overwritten.clear()
        self.step()
        if self.io_schedule.report_due(force=self.cadence.just_measured):
            self._report_async()
            self.exchange.forget_finished_uploads()
        if self.io_schedule.checkpoint_due():
            self._checkpoint_async()
        return True

    def _idle(self) -> None:
        """A tick while the syncer closes the run (`ddiloco.syncer.drain`): no step, so the answers just sent
        hold everything this learner trained; heartbeats go on; the next status is awaited a poll away."""
        if self.group is not None:  # the other ranks receive the versions applied, without a step
            self.group.lead_apply(self.exchange.overwritten, self.layout, self.params)
        self.exchange.overwritten.clear()
        if self.io_schedule.report_due():
            self._report_async()
            self.exchange.forget_finished_uploads()
        self._stop.wait(self.cfg.train.poll_every_s)

    def run(self, max_steps: int | None = None, wait_timeout: float | None = None) -> str:
        """Train until the syncer says done (or max_steps); returns the exit reason."""
        self.start(wait_timeout)
        reason = "max_steps"
        steps = 0
        try:
            while max_steps is None or steps < max_steps:
                if not self.tick():
                    reason = "done"
                    break
                steps += 1
        except BaseException:
            reason = "error"
            raise
        finally:
            self.close(reason)
        return reason

    def close(self, reason: str = "max_steps") -> None:
        """End this incarnation: stop its background work, settle pending answers when the run is `done`,
        and write its final report with `reason` (done, max_steps, error, ...)."""
        self._stop.set()
        if self.group is not None:
            self.group.stop()
        if self._loss_in_flight is not None:
            self.loss, self._loss_in_flight = float(self._loss_in_flight), None
        self.exchange.wait_uploads()
        if reason == "done":  # the run is over: settle every answer still pending
            try:
                self.poller.poll_once()
            except StoreError:
                pass
            self.exchange.settle_final(self.poller.latest)
        self.pool.shutdown(wait=True)
        self.heartbeats.shutdown()
        self.loader.close()  # a streamed loader's read-ahead thread
        self.cadence.finish()
        self._put_report(final=True, reason=reason)
        self.trainer_status.close(self.poller.latest, self.loss, self.efficiency)
        books = (self.inner_step, self.ledger.tokens_processed, dict(self.feed.fetched))
        msg = "learner %d incarnation %d exits (%s) after %d inner steps, %d tokens; downloads %s"
        log.info(msg, self.learner_id, self.incarnation, reason, *books)


def report_of(learner: Learner, final: bool, reason: str | None) -> LearnerReport:
    """The learner's report now (its `seq` already counted): books, pace, traffic, data, memory."""
    ex, ledger = learner.exchange, learner.ledger
    bytes_up, bytes_down, upload_failures = ex.traffic()
    return LearnerReport(
        run_id=learner.run_id,
        learner_id=learner.learner_id,
        incarnation=learner.incarnation,
        seq=learner.seq,
        time=time.time(),
        started_at=learner.started_at,
        joined_at=learner.joined_at,
        inner_step=learner.inner_step,
        host=host_name(),
        pid=os.getpid(),
        site=learner.site,
        tokens_processed=ledger.tokens_processed,
        busy_seconds=ledger.busy_seconds,
        loss=learner.loss,
        loss_ema=learner.loss_ema,
        step_time_ema=learner.step_time_ema,
        rounds_answered=ex.rounds_answered,
        step_wall_ema=learner.cadence.ema,
        productive_seconds=learner.cadence.productive_seconds,
        bytes_up=bytes_up,
        bytes_down=bytes_down,
        upload_failures=upload_failures,
        final=final,
        exit_reason=reason,
        fragments=ledger.snapshot(),
        rejected_globals=dict(learner.feed.rejected_globals),
        rejected_updates=dict(ex.rejected_updates),
        history=sample_history(
            learner.history, learner.loss_ema, learner.inner_step, ledger.tokens_processed
        ),
        lr=learner.schedule.last_lr,
        progress=learner.schedule.progress,
        data=learner.shard.read(learner.loader.epochs_read, learner._started_epochs, learner._by_source()),
        cursor=learner.cursor,
        peak_rss_bytes=peak_rss_bytes(),
        **learner.efficiency.figures(),
    )
