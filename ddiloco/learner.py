"""A learner: inner AdamW steps on its own shard, answering the syncer's rounds without ever waiting for it.

Design choices:
- The training loop never blocks on the store. A poller thread keeps the latest syncer status; uploads,
  downloads, reports and checkpoints run on a small thread pool. At each step boundary the main thread only
  (a) applies finished downloads, (b) snapshots deltas for open rounds, (c) schedules I/O.
- Per fragment p the learner keeps counters since it last *received* p (steps, tokens, seconds), its anchor
  (the global version received) and an anchor copy of the tensors, so an answer is a delta against the anchor.
- Token accounting is exact on the learner side: for every fragment, tokens processed by this incarnation =
  merged + discarded + outstanding (c_tokens). An answer is credited as merged only when the syncer's status
  names this incarnation among the round's contributors; everything else a new version overwrites is
  discarded. The report (heartbeat) is written *before* each upload so a crash between the two cannot make
  the syncer merge tokens the reports never mention.
- A learner never publishes from a random init: it waits for global version 0 and overwrites its params
  with the current globals before its first step (after restoring its own checkpoint, if any).
"""

from __future__ import annotations

import logging
import math
import os
import socket
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

import torch
from prometheus_client import CollectorRegistry

from ddiloco import wire
from ddiloco.chaos import LearnerChaos, schedule_from_config
from ddiloco.checkpoint import (
    load_learner_checkpoint,
    load_optimizer_tensors,
    optimizer_tensors,
    save_learner_checkpoint,
)
from ddiloco.compression import encode
from ddiloco.data import ShardLoader
from ddiloco.globalmodel import build_model, latest_version, read_global, read_layout
from ddiloco.metrics import LearnerMetrics
from ddiloco.model import configure_optimizer
from ddiloco.prepare import load_run_config, load_tokens
from ddiloco.store import Store, StoreError, StoreUnavailable

log = logging.getLogger(__name__)

HISTORY_POINTS = 400
HISTORY_EVERY_S = 1.0


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


def inner_step(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    lr: float,
    grad_clip: float,
) -> float:
    """One AdamW step; shared by the learner, the plain-loop benchmark and the baseline."""
    for group in opt.param_groups:
        group["lr"] = lr
    _, loss = model(x, y)
    loss.backward()
    if grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach())


def lr_at(step: int, peak: float, warmup: int) -> float:
    return peak * min(1.0, (step + 1) / max(1, warmup))


def resolve_device(name: str) -> torch.device:
    if name == "cuda" or (name == "auto" and torch.cuda.is_available()):
        return torch.device("cuda")
    return torch.device("cpu")


class StatusPoller(threading.Thread):
    """Keeps the newest syncer status in memory; survives an unavailable store with backoff."""

    def __init__(self, store: Store, every: float, stop: threading.Event) -> None:
        super().__init__(daemon=True, name="status-poller")
        self.store, self.every, self.stop = store, every, stop
        self.latest: dict[str, Any] | None = None
        self.errors = 0

    def poll_once(self) -> None:
        status = self.store.get_json_or_none(wire.STATUS)
        if status is not None:
            self.latest = status

    def run(self) -> None:
        delay = self.every
        while not self.stop.is_set():
            try:
                self.poll_once()
                delay = self.every
            except StoreError as e:
                self.errors += 1
                delay = min(5.0, max(delay * 2, 0.2))
                log.warning("status poll failed (%s); retrying in %.1fs, training continues", e, delay)
            self.stop.wait(delay)


class Learner:
    def __init__(
        self,
        store: Store,
        learner_id: int,
        *,
        device: str | None = None,
        threads: int | None = None,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.store = store
        self.learner_id = learner_id
        self.cfg = load_run_config(store)
        self.run_id = self.cfg.run_id
        t = self.cfg.train
        self.device = resolve_device(device or t.device)
        if self.device.type == "cpu":
            torch.set_num_threads(threads or t.threads)
        self.layout = read_layout(store)
        meta = store.get_json(wire.DATA_META)
        self.chaos = LearnerChaos(
            store, schedule_from_config(self.cfg.chaos, self.cfg.diloco.learners), learner_id,
            float(meta.get("prepared_at", time.time())), self.cfg.seed,
        )  # fmt: skip
        shard = learner_id % meta["num_shards"]
        self.loader = ShardLoader(
            load_tokens(store, wire.shard_key(shard), self.run_id),
            batch_size=t.batch_size, seq_len=self.cfg.model.seq_len, seed=self.cfg.seed * 1000 + learner_id,
        )  # fmt: skip
        self.model = build_model(self.layout, self.cfg.seed).to(self.device)
        self.opt = configure_optimizer(self.model, t.lr, t.weight_decay, (t.beta1, t.beta2))
        self.params = dict(self.model.named_parameters())
        self.frags = [FragmentState() for _ in self.layout.fragments]
        self.anchors: dict[str, torch.Tensor] = {}
        self.inner_step = 0
        self.tokens_processed = 0
        self.busy_seconds = 0.0
        self.loss: float | None = None
        self.loss_ema: float | None = None
        self.history: list[list[float]] = []  # [wall time, inner_step, tokens_processed, loss_ema], bounded
        self.step_time_ema: float | None = None
        self.rounds_answered = 0
        self.bytes_up = 0
        self.bytes_down = 0
        self.upload_failures = 0
        self.seq = 0
        self.started_at = time.time()
        self.joined_at: float | None = None
        self.incarnation = self._next_incarnation()
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = LearnerMetrics(self.registry, learner_id, self.incarnation)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.poller = StatusPoller(store, t.poll_every_s, self._stop)
        self.pool = ThreadPoolExecutor(max_workers=3, thread_name_prefix=f"learner{learner_id}-io")
        self.downloads: dict[int, Future] = {}
        self.uploads: list[Future] = []
        self._report_future: Future | None = None
        self._answered: set[int] = set()

    # --- start-up -------------------------------------------------------------------------------------------
    def _next_incarnation(self) -> int:
        prev = self.store.get_json_or_none(wire.incarnation_key(self.learner_id))
        inc = 0 if prev is None else int(prev["incarnation"]) + 1
        self.store.put_json(
            wire.incarnation_key(self.learner_id), {"incarnation": inc, "started_at": self.started_at}
        )
        return inc

    def _wait_for_globals(self, timeout: float | None) -> list[int]:
        """Block until every fragment has a global version (the only wait besides the end of the run)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                versions = [latest_version(self.store, f.fragment_id) for f in self.layout.fragments]
                if all(v is not None for v in versions):
                    return [int(v) for v in versions]  # type: ignore[arg-type]
            except StoreUnavailable as e:
                log.warning(
                    "learner %d: store unavailable while waiting for globals (%s)", self.learner_id, e
                )
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(
                    "global version 0 never appeared; is `ddiloco prepare` done for this store?"
                )
            time.sleep(0.2)

    def start(self, wait_timeout: float | None = None) -> None:
        ckpt = load_learner_checkpoint(self.store, self.learner_id, self.run_id, self.model, self.opt)
        if ckpt is not None:
            self.inner_step = int(ckpt["inner_step"])
            self.loader.load_state_dict(ckpt["cursor"])
            log.info("learner %d: restored checkpoint at inner step %d", self.learner_id, self.inner_step)
        versions = self._wait_for_globals(wait_timeout)
        for p, v in enumerate(versions):
            self._apply(p, v, read_global(self.store, self.run_id, self.layout, p, v), initial=True)
        self.poller.poll_once() if self.store.exists(wire.STATUS) else None
        self.poller.start()
        self.joined_at = time.time()
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
        with torch.no_grad():
            for name, t in tensors.items():
                g = t.to(self.device)
                if alpha > 0:
                    self.params[name].mul_(alpha).add_(g, alpha=1 - alpha)
                else:
                    self.params[name].copy_(g)
                self.anchors[name] = g.clone()
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
        me = wire.contributor(self.learner_id, self.incarnation)
        for m in status.get("merged", []):
            if m["round"] == round_ and m["fragment_id"] == p and m["version"] <= version:
                return me in m["contributors"]
        return False

    def _download(self, p: int, version: int) -> tuple[int, dict[str, torch.Tensor]]:
        tensors = read_global(self.store, self.run_id, self.layout, p, version)
        with self._lock:
            self.bytes_down += sum(t.numel() * 4 for t in tensors.values())
        self.metrics.downloaded.inc(sum(t.numel() * 4 for t in tensors.values()))
        return version, tensors

    def _sync_fragments(self, status: dict) -> None:
        """Apply finished downloads, start new ones, settle answers whose round closed without a merge."""
        for p, fut in list(self.downloads.items()):
            if not fut.done():
                continue
            del self.downloads[p]
            try:
                version, tensors = fut.result()
            except StoreError as e:
                log.warning(
                    "learner %d: download of fragment %d failed (%s); will retry", self.learner_id, p, e
                )
                continue
            if version > self.frags[p].anchor:
                self._apply(p, version, tensors, status=status)
        versions = status.get("versions", {})
        open_rounds = {r["round"] for r in status.get("open_rounds", [])}
        merged_rounds = {m["round"] for m in status.get("merged", [])}
        for p, fs in enumerate(self.frags):
            v = int(versions.get(str(p), fs.anchor))
            self.metrics.staleness.labels(learner_id=self.metrics.learner_id, fragment=str(p)).set(
                max(0, v - fs.anchor)
            )
            if v > fs.anchor and p not in self.downloads:
                self.downloads[p] = self.pool.submit(self._download, p, v)
            pend = fs.pending
            if pend is not None and pend["round"] not in open_rounds and pend["round"] not in merged_rounds:
                if pend["round"] < status.get("next_round", 0):
                    fs.pending = (
                        None  # closed without merging us: tokens stay outstanding for the next answer
                    )

    def _answer_rounds(self, status: dict) -> None:
        for r in status.get("open_rounds", []):
            s, p = int(r["round"]), int(r["fragment_id"])
            fs = self.frags[p]
            if s in self._answered or fs.pending is not None or fs.c_steps < 1 or p in self.downloads:
                continue
            self._answered.add(s)
            names = self.layout.fragments[p].names
            with torch.no_grad():
                delta = {n: (self.params[n].detach() - self.anchors[n]).float().cpu() for n in names}
            fs.pending = {"round": s, "tokens": fs.c_tokens, "seconds": fs.c_seconds, "steps": fs.c_steps}
            header = {
                "run_id": self.run_id, "kind": "update", "learner_id": self.learner_id, "incarnation": self.incarnation,
                "fragment_id": p, "round": s, "base_version": fs.anchor, "c_steps": fs.c_steps, "c_tokens": fs.c_tokens,
                "c_seconds": fs.c_seconds, "inner_step": self.inner_step, "codec": self.cfg.diloco.codec,
            }  # fmt: skip
            report = self._report()
            self.uploads.append(self.pool.submit(self._upload, p, s, delta, header, report))
            self.rounds_answered += 1
            self.metrics.rounds_answered.inc()

    def _upload(self, p: int, s: int, delta: dict[str, torch.Tensor], header: dict, report: dict) -> None:
        codec = self.cfg.diloco.codec
        tensors: dict[str, torch.Tensor] = {}
        for name, d in delta.items():
            for part, t in encode(d, codec).items():
                tensors[f"{name}/{part}"] = t
        blob = wire.pack(tensors, header)
        try:
            self.store.put_json(wire.report_key(self.learner_id, self.incarnation), report)
            self.store.put(wire.update_key(p, s, self.learner_id, self.incarnation), blob)
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
            "host": socket.gethostname(), "pid": os.getpid(),
            "tokens_processed": self.tokens_processed, "busy_seconds": self.busy_seconds, "loss": self.loss,
            "loss_ema": self.loss_ema, "step_time_ema": self.step_time_ema, "rounds_answered": self.rounds_answered,
            "bytes_up": bytes_up, "bytes_down": bytes_down, "upload_failures": self.upload_failures,
            "final": final, "exit_reason": reason, "fragments": {str(p): asdict(f) for p, f in enumerate(self.frags)},
            "history": self._sample_history(),
        }  # fmt: skip

    def _sample_history(self) -> list[list[float]]:
        """Append the current point; keep at most HISTORY_POINTS by dropping every other old point."""
        if self.loss_ema is not None and (
            not self.history or time.time() - self.history[-1][0] >= HISTORY_EVERY_S
        ):
            self.history.append([time.time(), self.inner_step, self.tokens_processed, self.loss_ema])
            if len(self.history) > HISTORY_POINTS:
                self.history = self.history[:-1:2] + self.history[-1:]
        return list(self.history)

    def _put_report(self, final: bool = False, reason: str | None = None) -> None:
        report = self._report(final, reason)
        try:
            self.store.put_json(wire.report_key(self.learner_id, self.incarnation), report)
        except StoreError as e:
            log.warning("learner %d: report not written (%s)", self.learner_id, e)

    def _report_async(self) -> None:
        self.metrics.store_retries.set(self.store.stats.retries)
        if self._report_future is None or self._report_future.done():
            report = self._report()
            self._report_future = self.pool.submit(
                self.store.put_json, wire.report_key(self.learner_id, self.incarnation), report
            )

    def _checkpoint_async(self) -> None:
        # Snapshot on the main thread (cheap CPU clone) so the background write sees a consistent state.
        meta = {"run_id": self.run_id, "cursor": self.loader.state_dict(), "incarnation": self.incarnation}
        step = self.inner_step
        snap_model = build_model(self.layout)
        snap_model.load_state_dict({k: v.detach().cpu() for k, v in self.model.state_dict().items()})
        snap_opt = configure_optimizer(snap_model, 1.0, 0.0)
        load_optimizer_tensors(
            snap_model,
            snap_opt,
            {k: v.cpu().clone() for k, v in optimizer_tensors(self.model, self.opt).items()},
        )

        def write() -> None:
            try:
                save_learner_checkpoint(self.store, self.learner_id, step, snap_model, snap_opt, meta)
            except StoreError as e:
                log.warning("learner %d: checkpoint at step %d failed (%s)", self.learner_id, step, e)

        self.pool.submit(write)

    # --- the loop --------------------------------------------------------------------------------------------
    def step(self) -> float:
        t0 = time.perf_counter()
        x, y = self.loader.next_batch()
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        t = self.cfg.train
        loss = inner_step(
            self.model, self.opt, x, y, lr_at(self.inner_step, t.lr, t.warmup_steps), t.grad_clip
        )
        try:
            self.chaos.after_step(self.inner_step + 1, time.perf_counter() - t0)
        except StoreError as e:
            log.warning("chaos hook skipped this step (%s)", e)
        dt = time.perf_counter() - t0
        if not math.isfinite(loss):
            raise FloatingPointError(
                f"learner {self.learner_id}: loss is {loss} at inner step {self.inner_step}; lower train.lr"
            )
        n = x.numel()
        self.inner_step += 1
        self.tokens_processed += n
        self.busy_seconds += dt
        for fs in self.frags:
            fs.c_steps += 1
            fs.c_tokens += n
            fs.c_seconds += dt
        self.loss = loss
        self.loss_ema = loss if self.loss_ema is None else 0.9 * self.loss_ema + 0.1 * loss
        self.step_time_ema = dt if self.step_time_ema is None else 0.9 * self.step_time_ema + 0.1 * dt
        m = self.metrics
        m.inner_steps.inc()
        m.tokens.inc(n)
        m.loss.set(loss)
        m.tokens_per_second.set(n / self.step_time_ema)
        return loss

    def tick(self) -> bool:
        """One iteration of the loop at a step boundary; False once the syncer says the run is done."""
        status = self.poller.latest
        if status is not None:
            if status.get("done"):
                return False
            self._sync_fragments(status)
            self._answer_rounds(status)
        self.step()
        now = time.monotonic()
        t = self.cfg.train
        if now >= self._next_report:
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
        for fut in self.uploads:
            try:
                fut.result(timeout=30)
            except Exception as e:  # the upload thread already logged its own store errors
                log.debug("upload ended with %s", e)
        if reason == "done":
            # The run is over: answers the final status names as merged are credited, the rest is discarded.
            try:
                self.poller.poll_once()
            except StoreError:
                pass
            status = self.poller.latest or {}
            for p, fs in enumerate(self.frags):
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
        self._put_report(final=True, reason=reason)
        log.info(
            "learner %d incarnation %d exits (%s) after %d inner steps, %d tokens",
            self.learner_id, self.incarnation, reason, self.inner_step, self.tokens_processed,
        )  # fmt: skip
