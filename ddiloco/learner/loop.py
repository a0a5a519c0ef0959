"""A learner: inner AdamW steps on its own shard, answering the syncer's rounds without ever waiting for it.

Design choices:
- The training loop never blocks on the store. A poller thread keeps the latest syncer status; uploads,
  downloads, reports and checkpoints run on a small thread pool. At each step boundary the main thread only
  (a) applies finished downloads, (b) snapshots deltas for open rounds, (c) schedules I/O.
- Per fragment p the learner keeps counters since it last *received* p (steps, tokens, seconds), its anchor
  (the global version received) and an anchor copy of the tensors, so an answer is a delta against the anchor.
- Token accounting is exact on the learner side: for every fragment, tokens processed by this incarnation =
  merged + discarded + outstanding (c_tokens). An answer is credited as merged only when the syncer's status
  or round record (`RoundRecords`) names this incarnation among the round's contributors; everything else a
  new version overwrites is discarded. A fragment is not overwritten while its pending answer's fate is
  unknown. The report (heartbeat) is written *before* each upload, and reports are written in order
  (`ReportWriter`), so a crash cannot make the syncer merge tokens the reports never mention.
- A learner never publishes from a random init: it waits for global version 0 and overwrites its params
  with the current globals before its first step (after restoring its own checkpoint, if any).
- Trust (`ddiloco.protocol.signing`): uploads and checkpoints are signed, every global, shard and checkpoint read is
  verified. A global version that fails is skipped (logged, counted by reason in `rejected_globals`) and
  training goes on until the next one; the syncer's rejections of this incarnation's answers are logged,
  counted (`rejected_updates`) and drop the pending answer, so its tokens stay outstanding.
- Devices (`ddiloco.learner.accel`, `ddiloco.learner.ddp`): on CUDA, bf16 autocast, fused AdamW, answers and checkpoints
  copied to pinned host buffers on a side stream, each loss read a step late; with torchrun ranks this
  process is rank 0, the only one on the store, and broadcasts every fragment it overwrites to the others.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

import torch
from prometheus_client import CollectorRegistry

from ddiloco import keys
from ddiloco.chaos.local import LearnerChaos, schedule_from_config
from ddiloco.chiptime import StepCadence
from ddiloco.config import ConfigError
from ddiloco.data import ShardLoader
from ddiloco.globalmodel import latest_version, read_global, read_layout
from ddiloco.hostname import host_name
from ddiloco.learner.accel import (
    HostCopier,
    HostSnapshot,
    maybe_compile,
    pin,
    place_optimizer_steps,
    resolve_device,
    resolve_precision,
    to_device,
    train_step,
)
from ddiloco.learner.checkpoint import load_learner_checkpoint
from ddiloco.learner.ddp import Group, rank_seed
from ddiloco.learner.io import (
    CheckpointWriter,
    ReportWriter,
    RoundRecords,
    StatusPoller,
    next_incarnation,
    pack_update,
    sample_history,
    snapshot_checkpoint,
)
from ddiloco.metrics import LearnerMetrics
from ddiloco.model import configure_optimizer, init_model
from ddiloco.prepare import load_run_config, load_tokens
from ddiloco.protocol import signing, wire
from ddiloco.schedule import GlobalSchedule
from ddiloco.store import NotFound, Store, StoreError, StoreUnavailable

__all__ = ["FragmentState", "Learner"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class FragmentState:
    anchor: int = 0
    """Global version of this fragment last received."""
    c_steps: int = 0
    c_tokens: int = 0
    c_seconds: float = 0.0
    merged_tokens: int = 0
    merged_seconds: float = 0.0
    discarded_tokens: int = 0
    pending: dict[str, Any] | None = None
    """The answer in flight: {round, tokens, seconds, steps}; cleared when its fate is known."""


class Learner:
    def __init__(
        self,
        store: Store,
        learner_id: int,
        *,
        device: str | None = None,
        threads: int | None = None,
        registry: CollectorRegistry | None = None,
        secret: bytes | None = None,
        site: str = "local",
        group: Group | None = None,
    ) -> None:
        """`secret`: the master key from DDILOCO_RUN_KEY (None: neither sign nor verify); `site`: where it runs;
        `group`: the learner's data-parallel ranks when this is rank 0 of several (`ddiloco.learner.ddp`)."""
        self.store, self.site = store, site
        self.learner_id = learner_id
        self.cfg = load_run_config(store)
        self.run_id = self.cfg.run_id
        self.key = signing.for_run(secret, self.run_id)
        if self.key is None:
            signing.warn_unsigned(f"learner {learner_id}")
        t = self.cfg.train
        self.group, self.world_size = group, 1 if group is None else group.world_size
        if self.world_size > t.ranks:
            raise ConfigError(f"learner runs {self.world_size} ranks but train.ranks={t.ranks}; raise it")
        self.device = resolve_device(device or t.device) if group is None else group.device
        self.precision = resolve_precision(t.precision, self.device)
        if self.device.type == "cpu":
            torch.set_num_threads(threads or t.threads)
        self.layout = read_layout(store)
        meta = store.get_json(keys.DATA_META)
        self.chaos = LearnerChaos(
            store, schedule_from_config(self.cfg.chaos, self.cfg.diloco.learners), learner_id,
            float(meta.get("prepared_at", time.time())), self.cfg.seed,
        )  # fmt: skip
        shard = learner_id % meta["num_shards"]
        self.loader = ShardLoader(
            load_tokens(
                store, keys.shard_key(shard), self.run_id, max_tokens=int(meta["shard_tokens"][shard]),
                run_key=self.key,
            ),
            batch_size=t.batch_for(learner_id), seq_len=self.cfg.model.seq_len,
            seed=rank_seed(self.cfg.seed * 1000 + learner_id, 0),
        )  # fmt: skip
        self.model = init_model(self.layout.gpt_config(), self.cfg.seed, device=self.device)
        self.opt = configure_optimizer(self.model, t.lr, t.weight_decay, (t.beta1, t.beta2))  # fused on CUDA
        self.net = maybe_compile(self.model, t.compile) if group is None else self.model  # DDP: `_join_ranks`
        self.copier = HostCopier(self.device)  # snapshots for answers and checkpoints
        self._defer_loss = self.device.type == "cuda"  # read each loss a step late: the host never waits
        self._loss_in_flight: torch.Tensor | None = None
        self._applied: list[int] = []  # fragments overwritten since the last step (broadcast to the ranks)
        self.checkpoints = CheckpointWriter(store, learner_id, self.layout, self.key)
        self.params = dict(self.model.named_parameters())
        self.frags = [FragmentState() for _ in self.layout.fragments]
        self.anchors: dict[str, torch.Tensor] = {}
        self.inner_step = 0
        self.schedule = GlobalSchedule(t, self.cfg.diloco.token_budget)  # inner LR on the run's progress
        self.tokens_processed = 0
        self.busy_seconds = 0.0
        self.loss: float | None = None
        self.loss_ema: float | None = None
        self.history: list[list[float]] = []  # [wall time, inner_step, tokens_processed, loss_ema], bounded
        self.step_time_ema: float | None = None
        self.cadence = StepCadence()  # wall seconds per step with the loop's overhead: what pacing needs
        self.rounds_answered = 0
        self.bytes_up = 0
        self.bytes_down = 0
        self.upload_failures = 0
        self.seq = 0
        self.started_at = time.time()
        self.joined_at: float | None = None
        self.incarnation = next_incarnation(store, learner_id, self.started_at)
        self.reports = ReportWriter(store, keys.report_key(learner_id, self.incarnation))
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = LearnerMetrics(self.registry, learner_id, self.incarnation, site)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.poller = StatusPoller(store, t.poll_every_s, self._stop)
        self.pool = ThreadPoolExecutor(max_workers=3, thread_name_prefix=f"learner{learner_id}-io")
        self.downloads: dict[int, Future] = {}
        self.uploads: list[Future] = []
        self._report_future: Future | None = None
        self._answered: set[int] = set()
        self.rounds = RoundRecords(store)  # the syncer's word on rounds of pending answers
        self.rejected_globals: Counter[str] = Counter()
        self.rejected_updates: Counter[str] = Counter()
        self._bad_globals: set[tuple[int, int]] = set()
        self._notices_seen: set[tuple[int, int]] = set()

    # --- start-up -------------------------------------------------------------------------------------------
    def _wait_for_globals(self, timeout: float | None) -> list[int]:
        """Block until every fragment has a global version (the only wait besides the end of the run)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                versions = [latest_version(self.store, f.fragment_id) for f in self.layout.fragments]
                if all(v is not None for v in versions):
                    return [int(v) for v in versions]  # type: ignore[arg-type]
            except (StoreUnavailable, wire.PayloadError) as e:
                log.warning(
                    "learner %d: store unavailable while waiting for globals (%s)", self.learner_id, e
                )
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(
                    "global version 0 never appeared; is `ddiloco prepare` done for this store?"
                )
            time.sleep(0.2)

    def _join_ranks(self, group: Group) -> None:
        """Hand the run and their slices of the shard to the other ranks, wrap the model in DDP. Done here, not
        in __init__ (which the CLI retries while the store is unavailable), so the ranks hand-shake once."""
        ld = self.loader
        tokens = group.lead_handshake(self.cfg, self.layout, self.learner_id, ld.tokens)
        self.loader = ShardLoader(tokens, batch_size=ld.batch_size, seq_len=ld.seq_len, seed=ld.seed)
        self.net = maybe_compile(group.wrap(self.model), self.cfg.train.compile)

    def start(self, wait_timeout: float | None = None) -> None:
        if self.group is not None:
            self._join_ranks(self.group)
        ckpt = load_learner_checkpoint(self.store, self.learner_id, self.run_id, self.model, self.opt, key=self.key)  # fmt: skip
        if ckpt is not None:
            self.inner_step = int(ckpt["inner_step"])
            place_optimizer_steps(self.opt)
            try:
                self.loader.load_state_dict(ckpt["cursor"])
            except ValueError as e:  # another number of ranks cut the shard differently
                log.warning("learner %d: data cursor not restored (%s); reading afresh", self.learner_id, e)
            log.info("learner %d: restored checkpoint at inner step %d", self.learner_id, self.inner_step)
        versions = self._wait_for_globals(wait_timeout)
        for p, v in enumerate(versions):
            versions[p], tensors = self._first_global(p, v)
            self._apply(p, versions[p], tensors, initial=True)
        if self.group is not None:  # every rank starts from rank 0's parameters, AdamW state and cursors
            self.group.lead_start(self.model, self.opt, self.inner_step, (ckpt or {}).get("cursors"))
        self.poller.poll_once() if self.store.exists(keys.STATUS) else None
        self.poller.start()
        self.joined_at = time.time()
        self.cadence.begin()
        log.info(
            "learner %d incarnation %d joined run %s at versions %s (device %s)",
            self.learner_id, self.incarnation, self.run_id, versions, self.device,
        )  # fmt: skip
        self._put_report()
        self._next_report = time.monotonic() + self.cfg.train.heartbeat_every_s
        self._next_ckpt = time.monotonic() + self.cfg.train.checkpoint_every_s

    # --- fragments in and out ---------------------------------------------------------------------------------
    def _apply(
        self,
        p: int,
        version: int,
        tensors: dict[str, torch.Tensor],
        initial: bool = False,
        status: dict | None = None,
    ) -> None:
        fs = self.frags[p]
        alpha = 0.0 if initial else self.cfg.diloco.mixing
        self.copier.fence()  # a checkpoint snapshot may still be reading the parameters
        with torch.no_grad():
            for name, t in tensors.items():
                g = t.to(self.device, non_blocking=True)  # pinned by `_download` on CUDA
                if alpha > 0:
                    self.params[name].mul_(alpha).add_(g, alpha=1 - alpha)
                else:
                    self.params[name].copy_(g)
                self.anchors[name] = g.clone() if g is t else g
        if not initial:
            self._applied.append(p)
        credited_tokens, credited_seconds = 0, 0.0
        if (
            fs.pending is not None
            and status is not None
            and self._credited(status, p, fs.pending["round"], version)
        ):
            credited_tokens, credited_seconds = fs.pending["tokens"], fs.pending["seconds"]
        fs.merged_tokens += credited_tokens
        fs.merged_seconds += credited_seconds
        fs.discarded_tokens += fs.c_tokens - credited_tokens
        self._count_fate(credited_tokens, fs.c_tokens - credited_tokens)
        fs.anchor, fs.c_steps, fs.c_tokens, fs.c_seconds, fs.pending = version, 0, 0, 0.0, None

    def _count_fate(self, merged: int, discarded: int) -> None:
        """Metrics count tokens, not fragment-tokens: each fragment's share is 1/P of a token."""
        P = self.layout.num_fragments
        self.metrics.merged_tokens.inc(merged / P)
        self.metrics.discarded_tokens.inc(discarded / P)

    def _credited(self, status: dict, p: int, round_: int, version: int) -> bool:
        m = self.rounds.merge_of(status, round_, p, version)
        return m is not None and keys.contributor(self.learner_id, self.incarnation) in m["contributors"]

    def _fate_known(self, status: dict, p: int) -> bool:
        """False while p's pending answer is in a round not known to be merged: applying a version would
        settle its tokens before the syncer's word (an open round, or a closed one whose record is read)."""
        pend = self.frags[p].pending
        return pend is None or self.rounds.decided(status, pend["round"])

    def _first_global(self, p: int, latest: int) -> tuple[int, dict[str, torch.Tensor]]:
        """The newest version ≤ latest of fragment p that verifies (a learner must start from a real one)."""
        for v in range(latest, -1, -1):
            try:
                return v, read_global(self.store, self.run_id, self.layout, p, v, key=self.key)
            except (wire.PayloadError, NotFound) as e:
                self._count_bad_global(p, v, getattr(e, "reason", "missing"), e)
        raise wire.PayloadError("unusable", f"no version of fragment {p} verifies; check {signing.ENV_VAR}")

    def _count_bad_global(self, p: int, version: int, reason: str, e: Exception) -> None:
        self._bad_globals.add((p, version))
        self.rejected_globals[reason] += 1
        self.metrics.rejected.labels(learner_id=str(self.learner_id), kind="global", reason=reason).inc()
        log.warning(
            "learner %d: skipping global version %d of fragment %d (%s); training continues",
            self.learner_id, version, p, e,
        )  # fmt: skip

    def _download(self, p: int, version: int) -> tuple[int, dict[str, torch.Tensor] | wire.PayloadError]:
        try:
            tensors = read_global(self.store, self.run_id, self.layout, p, version, key=self.key)
        except wire.PayloadError as e:  # returned, not raised: the caller needs the version it concerns
            return version, e
        tensors = pin(tensors, self.device)
        with self._lock:
            self.bytes_down += sum(t.numel() * 4 for t in tensors.values())
        self.metrics.downloaded.inc(sum(t.numel() * 4 for t in tensors.values()))
        return version, tensors

    def _sync_fragments(self, status: dict) -> None:
        """Apply finished downloads, start new ones, settle answers whose round closed without a merge."""
        pending = {fs.pending["round"]: fs for fs in self.frags if fs.pending is not None}
        for s in self.rounds.follow(self.pool, status, pending):
            # Closed without merging us: the tokens stay outstanding for the next answer.
            pending[s].pending = None
        for p, fut in list(self.downloads.items()):
            if not fut.done() or not self._fate_known(status, p):
                continue  # a version waits until the fate of the answer it would settle is known
            del self.downloads[p]
            try:
                version, tensors = fut.result()
            except StoreError as e:
                log.warning(
                    "learner %d: download of fragment %d failed (%s); will retry", self.learner_id, p, e
                )
                continue
            if isinstance(tensors, wire.PayloadError):  # never retried: the next version is taken instead
                self._count_bad_global(p, version, tensors.reason, tensors)
            elif version > self.frags[p].anchor:
                self._apply(p, version, tensors, status=status)
        self._read_notices(status)
        versions = status.get("versions", {})
        for p, fs in enumerate(self.frags):
            v = int(versions.get(str(p), fs.anchor))
            self.metrics.staleness.labels(learner_id=self.metrics.learner_id, fragment=str(p)).set(
                max(0, v - fs.anchor)
            )
            if v > fs.anchor and p not in self.downloads and (p, v) not in self._bad_globals:
                self.downloads[p] = self.pool.submit(self._download, p, v)

    def _read_notices(self, status: dict) -> None:
        """The syncer's rejections of this incarnation's answers: log, count, and drop the pending answer
        (its tokens stay outstanding and go into the next answer for that fragment)."""
        for n in status.get("rejections", []):
            me = (self.learner_id, self.incarnation)
            if not isinstance(n, dict) or (n.get("learner_id"), n.get("incarnation")) != me:
                continue
            key, reason = (n.get("round"), n.get("fragment_id")), str(n.get("reason"))[:40]
            if key in self._notices_seen or not all(isinstance(k, int) for k in key):
                continue
            self._notices_seen.add(key)
            self.rejected_updates[reason] += 1
            self.metrics.rejected.labels(learner_id=str(self.learner_id), kind="update", reason=reason).inc()
            log.warning(
                "learner %d: the syncer rejected its answer to round %d (fragment %d): %s",
                self.learner_id, key[0], key[1], reason,
            )  # fmt: skip
            for p, fs in enumerate(self.frags):
                if p == key[1] and fs.pending is not None and fs.pending["round"] == key[0]:
                    fs.pending = None

    def _answer_rounds(self, status: dict) -> None:
        for r in status.get("open_rounds", []):
            s, p = int(r["round"]), int(r["fragment_id"])
            fs = self.frags[p]
            if s in self._answered or fs.pending is not None or fs.c_steps < 1 or p in self.downloads:
                continue
            self._answered.add(s)
            names = self.layout.fragments[p].names
            with torch.no_grad():  # queued on the device; copied to the host without stalling it
                delta = {n: (self.params[n].detach() - self.anchors[n]).float() for n in names}
            snap = self.copier.snapshot(delta, copy=False)
            fs.pending = {"round": s, "tokens": fs.c_tokens, "seconds": fs.c_seconds, "steps": fs.c_steps}
            header = {
                "run_id": self.run_id, "kind": "update", "learner_id": self.learner_id, "incarnation": self.incarnation,
                "fragment_id": p, "round": s, "base_version": fs.anchor, "c_steps": fs.c_steps, "c_tokens": fs.c_tokens,
                "c_seconds": fs.c_seconds, "inner_step": self.inner_step, "codec": self.cfg.diloco.codec,
            }  # fmt: skip
            report = self._report()
            self.uploads.append(self.pool.submit(self._upload, p, s, snap, header, report))
            self.rounds_answered += 1
            self.metrics.rounds_answered.inc()

    def _upload(self, p: int, s: int, snap: HostSnapshot, header: dict, report: dict) -> None:
        blob = pack_update(snap, self.cfg.diloco.codec, header, self.key)
        try:
            self.reports.write(report)  # or a newer one is stored already, which names this answer too
            self.store.put(keys.update_key(p, s, self.learner_id, self.incarnation), blob)
        except StoreError as e:
            with self._lock:
                self.upload_failures += 1
            self.metrics.upload_failures.inc()
            log.warning(
                "learner %d: upload for round %d failed (%s); the tokens stay outstanding",
                self.learner_id,
                s,
                e,
            )
            return
        with self._lock:
            self.bytes_up += len(blob)
        self.metrics.uploaded.inc(len(blob))

    # --- reports ---------------------------------------------------------------------------------------------
    def _report(self, final: bool = False, reason: str | None = None) -> dict[str, Any]:
        self.seq += 1
        with self._lock:
            bytes_up, bytes_down = self.bytes_up, self.bytes_down
        return {
            "run_id": self.run_id, "learner_id": self.learner_id, "incarnation": self.incarnation, "seq": self.seq,
            "time": time.time(), "started_at": self.started_at, "joined_at": self.joined_at, "inner_step": self.inner_step,
            "host": host_name(), "pid": os.getpid(), "site": self.site,
            "tokens_processed": self.tokens_processed, "busy_seconds": self.busy_seconds, "loss": self.loss,
            "loss_ema": self.loss_ema, "step_time_ema": self.step_time_ema, "rounds_answered": self.rounds_answered,
            "step_wall_ema": self.cadence.ema, "productive_seconds": self.cadence.productive_seconds,
            "bytes_up": bytes_up, "bytes_down": bytes_down, "upload_failures": self.upload_failures,
            "final": final, "exit_reason": reason, "fragments": {str(p): asdict(f) for p, f in enumerate(self.frags)},
            "rejected_globals": dict(self.rejected_globals), "rejected_updates": dict(self.rejected_updates),
            "history": sample_history(self.history, self.loss_ema, self.inner_step, self.tokens_processed),
            "lr": self.schedule.last_lr, "progress": self.schedule.progress,
        }  # fmt: skip

    def _put_report(self, final: bool = False, reason: str | None = None) -> None:
        report = self._report(final, reason)
        try:
            self.reports.write(report)
        except StoreError as e:
            log.warning("learner %d: report not written (%s)", self.learner_id, e)

    def _report_async(self) -> None:
        self.metrics.store_retries.set(self.store.stats.retries)
        if self._report_future is None or self._report_future.done():
            self._report_future = self.pool.submit(self.reports.write, self._report())

    def _checkpoint_async(self) -> None:
        """Snapshot at this step boundary into host buffers (asynchronous on CUDA); an I/O thread writes it."""
        cursor = self.loader.state_dict()
        meta = {"run_id": self.run_id, "cursor": cursor, "incarnation": self.incarnation}
        if self.group is not None:
            meta["cursors"] = self.group.gather_cursors(cursor)
        snap = snapshot_checkpoint(self.copier, self.model, self.opt)
        self.checkpoints.submit(self.pool, self.inner_step, snap, meta)

    # --- the loop --------------------------------------------------------------------------------------------
    def step(self) -> float | None:
        """One inner step; returns its loss (on CUDA the previous step's, read once this one is queued, so
        the device never waits for the host; None on the first step)."""
        t0 = time.perf_counter()
        x, y = self.loader.next_batch()
        x, y = to_device(x, self.device), to_device(y, self.device)
        t = self.cfg.train
        loss_t = train_step(
            self.net, self.opt, x, y, self.schedule.lr(self.inner_step), t.grad_clip,
            precision=self.precision, before_update=self.copier.fence,
        )  # fmt: skip
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
        n = x.numel() * self.world_size
        self.inner_step += 1
        self.tokens_processed += n
        self.busy_seconds += dt
        for fs in self.frags:
            fs.c_steps += 1
            fs.c_tokens += n
            fs.c_seconds += dt
        self.step_time_ema = dt if self.step_time_ema is None else 0.9 * self.step_time_ema + 0.1 * dt
        self.cadence.step_done(dt)
        m = self.metrics
        m.inner_steps.inc()
        m.tokens.inc(n)
        m.tokens_per_second.set(n / self.step_time_ema)
        m.learning_rate.set(self.schedule.last_lr or 0.0)
        if loss is not None:
            self.loss = loss
            self.loss_ema = loss if self.loss_ema is None else 0.9 * self.loss_ema + 0.1 * loss
            m.loss.set(loss)
        return loss

    def tick(self) -> bool:
        """One iteration of the loop at a step boundary; False once the syncer says the run is done."""
        status = self.poller.latest
        merged = self.schedule.observe(status)  # read once: all ranks of this learner step at this progress
        if status is not None:
            if status.get("done"):
                return False
            self._sync_fragments(status)
            self._answer_rounds(status)
        if self.group is not None:  # the other ranks step too, after receiving the fragments overwritten here
            self.group.lead_step(self.inner_step, self._applied, self.layout, self.params, merged)
        self._applied.clear()
        self.step()
        now = time.monotonic()
        t = self.cfg.train
        if now >= self._next_report or self.cadence.just_measured:
            self._report_async()
            self.uploads = [f for f in self.uploads if not f.done()]
            self._next_report = now + t.heartbeat_every_s
        if now >= self._next_ckpt:
            self._checkpoint_async()
            self._next_ckpt = now + t.checkpoint_every_s
        return True

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
            self._finish(reason)
        return reason

    def _finish(self, reason: str) -> None:
        self._stop.set()
        if self.group is not None:
            self.group.stop()
        if self._loss_in_flight is not None:
            self.loss, self._loss_in_flight = float(self._loss_in_flight), None
        for fut in self.uploads:
            try:
                fut.result(timeout=30)
            except Exception as e:  # the upload thread already logged its own store errors
                log.debug("upload ended with %s", e)
        if reason == "done":
            # The run is over: answers the final status or their round record names as merged are credited,
            # the rest is discarded.
            try:
                self.poller.poll_once()
            except StoreError:
                pass
            status = self.poller.latest or {}
            for p, fs in enumerate(self.frags):
                if not self._fate_known(status, p):  # merged too long ago for the status to list it?
                    try:
                        self.rounds.read(fs.pending["round"])
                    except StoreError as e:  # the final report keeps it pending: the summary settles it
                        log.warning("learner %d: answer left pending (%s)", self.learner_id, e)
                        continue
                credited = fs.pending is not None and self._credited(status, p, fs.pending["round"], 1 << 62)
                if credited:
                    fs.merged_tokens += fs.pending["tokens"]
                    fs.merged_seconds += fs.pending["seconds"]
                fs.discarded_tokens += fs.c_tokens - (fs.pending["tokens"] if credited else 0)
                self._count_fate(
                    fs.pending["tokens"] if credited else 0,
                    fs.c_tokens - (fs.pending["tokens"] if credited else 0),
                )
                fs.c_steps, fs.c_tokens, fs.c_seconds, fs.pending = 0, 0, 0.0, None
        self.pool.shutdown(wait=True)
        self.cadence.finish()
        self._put_report(final=True, reason=reason)
        log.info(
            "learner %d incarnation %d exits (%s) after %d inner steps, %d tokens",
            self.learner_id, self.incarnation, reason, self.inner_step, self.tokens_processed,
        )  # fmt: skip
