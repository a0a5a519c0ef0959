"""The learner's helpers around the loop: status poller, incarnations, history, the I/O schedule, reports and
checkpoints off the loop.

The poller thread keeps the newest syncer status and survives an unavailable store; the loop only reads
`latest`. A checkpoint is snapshotted at a step boundary into host buffers and written by an I/O thread.
Reports are built on the loop (numbered by `seq`) and written through one `ReportWriter`, never an older over
a newer; an answer's report is written before its update. Whether an answer was merged is the syncer's
round record; the status lists only the last 8P+16 merges, so `RoundRecords` reads the record of a closed
round the status does not list any more.

Design notes: docs/internals.md, "Around the loop".
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from collections.abc import Collection
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from ddiloco import keys
from ddiloco.codec import registry
from ddiloco.codec.blockwise import PACKING
from ddiloco.codec.encoded import EncodedTensor
from ddiloco.learner.accel import HostCopier, HostSnapshot
from ddiloco.learner.checkpoint import optimizer_tensors, write_checkpoint
from ddiloco.learner.health import IoErrors, guard
from ddiloco.platform.hostname import host_name
from ddiloco.protocol import signing, wire
from ddiloco.protocol.messages import Merged, RoundRecord, Status
from ddiloco.run.root import RunRoot
from ddiloco.store.base import Store, StoreError

log = logging.getLogger(__name__)

HISTORY_POINTS = 400
HISTORY_EVERY_S = 1.0


def next_incarnation(store: Store, learner_id: int, started_at: float) -> int:
    """Claim this start's incarnation number atomically: the first free number from the pointer's hint on
    whose write-once claim object (`keys.incarnation_claim_key`, created with `Store.create`) this process
    wins. Two processes that start as the same learner at once (an Argo retry while the old pod still runs,
    a person starting one by hand) get different numbers, so their reports and updates never collide."""
    prev = store.get_json_or_none(keys.incarnation_key(learner_id))
    inc = 0 if prev is None else int(prev["incarnation"]) + 1
    claim = {"started_at": started_at, "host": host_name(), "pid": os.getpid(), "nonce": secrets.token_hex(8)}
    while not store.create_json(keys.incarnation_claim_key(learner_id, inc), {"incarnation": inc, **claim}):
        inc += 1  # another start took it (or the hint was stale): the next one
    store.put_json(keys.incarnation_key(learner_id), {"incarnation": inc, "started_at": started_at})
    return inc


def sample_history(
    history: list[list[float]], loss_ema: float | None, inner_step: int, tokens: int
) -> list[list[float]]:
    """Append the current point to `history` (in place, at most every HISTORY_EVERY_S); keep at most
    HISTORY_POINTS by dropping every other old point; return a copy."""
    if loss_ema is not None and (not history or time.time() - history[-1][0] >= HISTORY_EVERY_S):
        history.append([time.time(), inner_step, tokens, loss_ema])
        if len(history) > HISTORY_POINTS:
            history[:] = history[:-1:2] + history[-1:]
    return list(history)


class IoSchedule:
    """When the loop writes a heartbeat report and a checkpoint: deadlines on the monotonic clock, checked at
    step boundaries (the loop never waits for them). A heartbeat may also be forced early: the first cadence
    measurement is what rounds are paced by, so the syncer should read it at once."""

    def __init__(self, heartbeat_every_s: float, checkpoint_every_s: float) -> None:
        self.heartbeat_every_s, self.checkpoint_every_s = heartbeat_every_s, checkpoint_every_s
        self.next_report = self.next_checkpoint = 0.0

    def begin(self) -> None:
        """Start both clocks now (after the start-up report)."""
        now = time.monotonic()
        self.next_report = now + self.heartbeat_every_s
        self.next_checkpoint = now + self.checkpoint_every_s

    def report_due(self, force: bool = False) -> bool:
        """Whether a heartbeat is due (or `force`d); if so, the next one is a full period from now."""
        now = time.monotonic()
        if now < self.next_report and not force:
            return False
        self.next_report = now + self.heartbeat_every_s
        return True

    def checkpoint_due(self) -> bool:
        now = time.monotonic()
        if now < self.next_checkpoint:
            return False
        self.next_checkpoint = now + self.checkpoint_every_s
        return True


class ReportWriter:
    """Writes one incarnation's report from any I/O thread: one write at a time, newest `seq` wins. A report
    older than the one last written is dropped, so a slow heartbeat can never overwrite the report an answer
    was uploaded after (which names that answer as pending) and hide merged tokens from every report."""

    def __init__(self, store: Store, key: str, keys_: signing.RunKeys | None = None) -> None:
        """`keys_`: the run's keys; reports are signed with the learner key (the syncer reads no other)."""
        self.store, self.key, self.keys = store, key, keys_
        self._lock = threading.Lock()
        self.written_seq = 0

    def write(self, report: dict[str, Any]) -> bool:
        """Write `report` unless a newer one is already stored (False); a store error is raised."""
        with self._lock:
            if report["seq"] <= self.written_seq:
                return False
            self.store.put_json(self.key, signing.sign_doc(report, self.keys, signing.LEARNER))
            self.written_seq = report["seq"]
            return True


class RoundRecords:
    """The syncer's merges of rounds this learner has pending answers to: the status's recent `merged` list,
    and round records read from the store for closed rounds the status no longer lists. Used by the loop
    thread only; the I/O pool just fetches (`errors`: where its bugs are counted; one is raised again when
    its read is collected)."""

    def __init__(
        self, store: Store, errors: IoErrors | None = None, keys_: signing.RunKeys | None = None
    ) -> None:
        """`keys_`: the run's keys; a round record the syncer did not sign is treated as absent."""
        self.store, self.errors, self.keys = store, errors, keys_
        self.known: dict[int, Merged] = {}  # round -> its merge, as the status lists one
        self._reads: dict[int, Future] = {}

    def _fetch(self, round_: int) -> Merged | None:
        key = keys.round_record_key(round_)
        rec = self.store.get_json_or_none(key)
        if rec is not None and (problem := signing.check_doc(rec, self.keys, signing.SYNCER)) is not None:
            log.warning("ignoring round record %s: %s", key, problem)
            return None
        return None if rec is None else Merged.of(RoundRecord.from_json(rec, key))

    def read(self, round_: int) -> Merged | None:
        """Read the round's record into `known` now; None if it has none (it never merged). May raise
        StoreError."""
        merge = self._fetch(round_)
        if merge is not None:
            self.known[round_] = merge
        return merge

    def merge_of(self, status: Status | None, round_: int, p: int, version: int) -> Merged | None:
        """The merge of `round_` (fragment p) into a version ≤ `version`, if the status or a record shows one."""
        for m in [*(status.merged if status else []), self.known.get(round_)]:
            if m is not None and m.round == round_ and m.fragment_id == p and m.version <= version:
                return m
        return None

    def decided(self, status: Status | None, round_: int) -> bool:
        """Whether the status or a record read so far shows the round merged (with this learner or not)."""
        return round_ in self.known or any(m.round == round_ for m in (status.merged if status else []))

    def follow(self, pool: ThreadPoolExecutor, status: Status, pending: Collection[int]) -> list[int]:
        """Start or collect record reads for pending rounds that closed unlisted; returns those found without
        a record (closed without a merge). Forgets rounds no longer pending."""
        self.known = {s: m for s, m in self.known.items() if s in pending}
        self._reads = {s: f for s, f in self._reads.items() if s in pending}
        open_rounds = {r.round for r in status.open_rounds}
        unmerged = []
        for s in pending:
            if self.decided(status, s) or s in open_rounds or s >= status.next_round:
                continue
            fut = self._reads.get(s)
            if fut is None:
                self._reads[s] = pool.submit(guard(self.errors, "record", self._fetch), s)
                continue
            if not fut.done():
                continue
            del self._reads[s]
            try:
                merge = fut.result()
            except StoreError as e:
                log.warning("round record %d unreadable (%s); will retry", s, e)
                continue
            if merge is None:
                unmerged.append(s)
            else:
                self.known[s] = merge
        return unmerged


class StatusPoller(threading.Thread):
    """Keeps the newest syncer status in memory, read and checked once (`Status`); survives an unavailable
    store, or a status that does not read, with backoff."""

    def __init__(
        self, store: Store, every: float, stop: threading.Event, keys_: signing.RunKeys | None = None
    ) -> None:
        """`keys_`: the run's keys; a status the syncer did not sign is refused (a StoreError, counted)."""
        super().__init__(daemon=True, name="status-poller")
        self.store, self.every, self.stop, self.keys = store, every, stop, keys_
        self.latest: Status | None = None
        self.first_seen: dict[int, float] = {}
        """round -> monotonic time of the first fetched status that listed it open (replaced, not mutated,
        so the loop's thread reads a consistent dict)."""
        self.errors = 0
        self.refused = 0
        """Statuses read that the syncer did not sign (ignored; the last signed one is kept)."""

    def poll_once(self) -> None:
        """Fetch the status; one that does not read as a `Status` is a StoreError (the last one is kept)."""
        doc = self.store.get_json_or_none(keys.STATUS)
        if doc is not None:
            problem = signing.check_doc(doc, self.keys, signing.SYNCER)
            if problem is not None:  # a forgery (or a status of a syncer without the key): never acted on
                self.refused += 1
                if self.refused == 1 or self.refused % 100 == 0:
                    log.warning(
                        "ignoring a status the syncer did not sign (%s; %d so far)", problem, self.refused
                    )
                return
            try:
                status = Status.from_json(doc)
            except ValueError as e:
                raise StoreError(f"unreadable status ({e})") from None
            now, seen = time.monotonic(), self.first_seen
            rounds = [r.round for r in status.open_rounds]
            self.first_seen = {s: seen.get(s, now) for s in rounds}
            self.latest = status

    def poll(self, delay: float) -> float:
        """One pass of the thread: poll, counting and logging a store error (`errors`); returns the delay
        before the next pass (`delay`, the last one, doubled after a failure, up to 5 s)."""
        try:
            self.poll_once()
            return self.every
        except StoreError as e:
            self.errors += 1
            delay = min(5.0, max(delay * 2, 0.2))
            log.warning("status poll failed (%s); retrying in %.1fs, training continues", e, delay)
            return delay

    def run(self) -> None:
        delay = self.every
        while not self.stop.is_set():
            delay = self.poll(delay)
            self.stop.wait(delay)


def pack_update(snap: HostSnapshot, codec: str, header: dict, signer: wire.RunSigner) -> bytes:
    """An answer's payload: the delta snapshot encoded with the upload codec, packed and signed (on an I/O
    thread); the snapshot's buffers are released."""
    tensors: dict[str, torch.Tensor] = {}
    norms: dict[str, float] = {}
    try:
        upload = registry.get(codec)
        for name, d in snap.wait().items():
            parts = upload.encode(d)
            # The norm of what the syncer will decode, so it can add Δ/‖Δ‖ in one pass (`ddiloco.codec.encoded`).
            norms[name] = EncodedTensor(codec, d.shape, parts).norm()
            for part, t in parts.items():
                tensors[f"{name}/{part}"] = t
        return signer.pack(tensors, {**header, "norms": norms, "packing": PACKING})
    finally:
        snap.release()


def snapshot_checkpoint(
    copier: HostCopier, model: torch.nn.Module, opt: torch.optim.Optimizer, group: Any = None
) -> HostSnapshot:
    """AdamW state (`opt/{name}/{field}`) copied to the host: what a rejoin needs besides the globals (a
    sharded learner's `group` gathers it from the ranks, `ddiloco.learner.sharded`)."""
    if group is not None and group.sharded:
        from ddiloco.learner.sharded import save_optimizer

        return copier.snapshot(save_optimizer(group, model, opt), copy=False)
    return copier.snapshot(optimizer_tensors(model, opt))


class CheckpointWriter:
    """Writes checkpoint snapshots on the I/O pool one at a time, in step order. A snapshot still waiting when
    a newer one arrives is dropped for it: at most two exist (one being written, the newest waiting), so a
    slow store never piles them up, and the newest state is always the next written. A bug in a write is
    logged and counted (`errors`, kind `checkpoint`); the next checkpoint tries again."""

    def __init__(self, root: RunRoot, learner_id: int, errors: IoErrors | None = None) -> None:
        self.root, self.learner_id, self.errors = root, learner_id, errors
        self._write_lock, self._slot_lock = threading.Lock(), threading.Lock()
        self._waiting: tuple[int, HostSnapshot, dict[str, Any]] | None = None

    def submit(self, pool: ThreadPoolExecutor, step: int, snap: HostSnapshot, meta: dict[str, Any]) -> None:
        with self._slot_lock:
            dropped, self._waiting = self._waiting, (step, snap, meta)
        if dropped is None:  # no writer is waiting for the slot: start one
            pool.submit(guard(self.errors, "checkpoint", self._drain))
        else:  # the waiting writer takes the new snapshot instead
            dropped[1].wait()
            dropped[1].release()

    def _drain(self) -> None:
        with self._write_lock:
            with self._slot_lock:
                job, self._waiting = self._waiting, None
            if job is not None:
                step, snap, meta = job
                written = write_snapshot(self.root, self.learner_id, step, snap, meta)
                if not written and self.errors is not None:
                    self.errors.store_error()


def write_snapshot(
    root: RunRoot, learner_id: int, step: int, snap: HostSnapshot, meta: dict[str, Any]
) -> bool:
    """Write a snapshot as a learner checkpoint (`ddiloco.learner.checkpoint.write_checkpoint`); a store error
    is logged, not raised (False)."""
    try:
        write_checkpoint(root, learner_id, step, snap.wait(), meta)
        return True
    except StoreError as e:
        log.warning("learner %d: checkpoint at step %d failed (%s)", learner_id, step, e)
        return False
    finally:
        snap.release()
