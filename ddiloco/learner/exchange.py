"""The learner's side of the protocol: answers up, new global versions in, the syncer's word on each answer.

Design choices:
- At a step boundary the loop hands the newest status to `sync` (apply what finished downloading, start new
  downloads, settle answers whose round closed) and to `answer_rounds` (snapshot a delta for each open round
  of a fragment that can answer). Every store access runs on the I/O pool the caller owns and passes in.
- An answer is credited as merged only when the syncer's status or round record (`RoundRecords`) names this
  incarnation among the round's contributors: the one rule, `ddiloco.protocol.messages.credited`. A fragment
  is not overwritten while its pending answer's fate is unknown (an open round, or a closed one whose record
  is still being read), so a version never settles tokens before the syncer's word.
- An answer's report is built (naming the answer as pending) before its update is uploaded, and written
  first, on the same I/O thread: a crash cannot make the syncer merge tokens the reports never mention.
- The syncer's rejections of this incarnation's answers are logged, counted (`rejected_updates`) and drop
  the pending answer: its tokens stay outstanding and go into the next answer for that fragment.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ddiloco import keys
from ddiloco.config.run import DilocoConfig
from ddiloco.learner.accel import HostSnapshot
from ddiloco.learner.health import guard
from ddiloco.learner.io import ReportWriter, RoundRecords, pack_update
from ddiloco.learner.ledger import FragmentLedger, Settled
from ddiloco.learner.versions import VersionFeed
from ddiloco.protocol.learner_report import LearnerReport
from ddiloco.protocol.messages import Status, credited
from ddiloco.protocol.update import UpdateHeader
from ddiloco.run.globalmodel import Received
from ddiloco.store.base import Store, StoreError
from ddiloco.tracking.metrics import LearnerMetrics

__all__ = ["Exchange"]

log = logging.getLogger(__name__)

AFTER_THE_END = 1 << 62  # a version bound past any real one: at the end of the run, any merge counts


class Exchange:
    """One learner incarnation's rounds and versions. `overwritten`: fragments overwritten since the caller
    last cleared it (what the other ranks must receive)."""

    def __init__(
        self,
        store: Store,
        ledger: FragmentLedger,
        feed: VersionFeed,
        reports: ReportWriter,
        metrics: LearnerMetrics,
        incarnation: int,
        diloco: DilocoConfig,
    ) -> None:
        """`diloco`: the run's outer settings, read when used (`mixing`, the upload `codec`). The I/O threads'
        store errors and bugs are counted where the feed's are (`feed.errors`, `ddiloco.learner.health`)."""
        self.store, self.ledger, self.feed, self.reports, self.metrics = store, ledger, feed, reports, metrics
        self.incarnation, self.diloco, self.errors = incarnation, diloco, feed.errors
        self.layout, self.learner_id = feed.layout, feed.learner_id
        self.signer = feed.signer
        self.rounds = RoundRecords(
            store, feed.errors, feed.signer.key
        )  # the syncer's word on rounds of pending answers
        self.uploads: list[Future] = []
        self.overwritten: list[int] = []
        self.rounds_answered = 0
        self.bytes_up = 0
        self.upload_failures = 0
        self.rejected_updates: Counter[str] = Counter()
        self._answered: set[int] = set()
        self._notices_seen: set[tuple[int, int]] = set()
        self._lock = threading.Lock()

    # --- versions in ----------------------------------------------------------------------------------------
    def join(self, latest: list[int]) -> list[int]:
        """Take the newest verifying version ≤ `latest[p]` of every fragment as it is; returns them."""
        versions = []
        for p, v in enumerate(latest):
            got = self.feed.first(p, v)
            self.feed.overwrite(p, got, mixing=0.0)
            self._settle(self.ledger.applied(p, got.version, credited=False))
            versions.append(got.version)
        return versions

    def sync(self, pool: ThreadPoolExecutor, status: Status) -> None:
        """Apply finished downloads, start new ones, settle answers whose round closed without a merge."""
        pending = self.ledger.pending_rounds()
        for s in self.rounds.follow(pool, status, pending):
            self.ledger.drop_pending(pending[s], s)  # closed without merging us: the tokens stay outstanding
        for p, got in self.feed.collect(lambda p: self._fate_known(status, p)):
            if got.version > self.ledger[p].anchor:
                self._apply(p, got, status)
        self._read_notices(status)
        for p, books in enumerate(self.ledger):
            v = status.versions[p] if p < len(status.versions) else books.anchor
            self.metrics.staleness.labels(learner_id=self.metrics.learner_id, fragment=str(p)).set(
                max(0, v - books.anchor)
            )
            if v > books.anchor:
                self.feed.request(pool, p, v)

    def _apply(self, p: int, got: Received, status: Status) -> None:
        self.feed.overwrite(p, got, self.diloco.mixing)
        self.overwritten.append(p)
        pend = self.ledger[p].pending
        merged = pend is not None and self._credited(status, p, pend.round, got.version)
        self._settle(self.ledger.applied(p, got.version, merged))

    # --- the syncer's word ----------------------------------------------------------------------------------
    def _credited(self, status: Status | None, p: int, round_: int, version: int) -> bool:
        return credited(self.rounds.merge_of(status, round_, p, version), self.learner_id, self.incarnation)

    def _fate_known(self, status: Status | None, p: int) -> bool:
        """False while p's pending answer is in a round not known to be merged: applying a version would
        settle its tokens before the syncer's word (an open round, or a closed one whose record is read)."""
        pend = self.ledger[p].pending
        return pend is None or self.rounds.decided(status, pend.round)

    def _settle(self, settled: Settled) -> None:
        """Metrics count tokens, not fragment-tokens: each fragment's share is 1/P of a token."""
        P = self.layout.num_fragments
        self.metrics.merged_tokens.inc(settled.merged / P)
        self.metrics.discarded_tokens.inc(settled.discarded / P)

    def _read_notices(self, status: Status) -> None:
        """The syncer's rejections of this incarnation's answers: log, count, and drop the pending answer
        (its tokens stay outstanding and go into the next answer for that fragment)."""
        me = (self.learner_id, self.incarnation)
        for n in status.rejections:
            if (n.learner_id, n.incarnation) != me:
                continue
            key, reason = (n.round, n.fragment_id), n.reason[:40]
            if key in self._notices_seen:
                continue
            self._notices_seen.add(key)
            self.rejected_updates[reason] += 1
            self.metrics.rejected.labels(learner_id=str(self.learner_id), kind="update", reason=reason).inc()
            log.warning(
                "learner %d: the syncer rejected its answer to round %d (fragment %d): %s",
                self.learner_id,
                key[0],
                key[1],
                reason,
            )
            if 0 <= key[1] < len(self.ledger):
                self.ledger.drop_pending(key[1], key[0])

    def settle_final(self, status: Status | None) -> None:
        """The run is over: answers the final status (None: none was read) or their round record names as
        merged are credited, the rest is discarded."""
        for p, books in enumerate(self.ledger):
            if not self._fate_known(status, p):  # merged too long ago for the status to list it?
                try:
                    self.rounds.read(books.pending.round)  # type: ignore[union-attr]
                except StoreError as e:  # the final report keeps it pending: the summary settles it
                    log.warning("learner %d: answer left pending (%s)", self.learner_id, e)
                    continue
            pend = books.pending
            merged = pend is not None and self._credited(status, p, pend.round, AFTER_THE_END)
            self._settle(self.ledger.settle_final(p, merged))

    # --- answers out ----------------------------------------------------------------------------------------
    def answer_rounds(
        self,
        pool: ThreadPoolExecutor,
        status: Status,
        inner_step: int,
        report: Callable[[], LearnerReport],
        seen_at: Mapping[int, float] | None = None,
    ) -> None:
        """Answer every open round of a fragment that has steps, no answer in flight and no version coming:
        its delta is snapshotted now and uploaded, after `report()` (built now), by an I/O thread.
        `seen_at`: round -> monotonic time this learner first saw it open (`StatusPoller.first_seen`); the
        header's `wait_s` is the time from then to now, the part of the answer's delay that is this
        learner's own (finishing a step, an answer in flight), which the syncer's grace window does not
        stretch for (`ddiloco.syncer.rounds`)."""
        now = time.monotonic()
        for r in status.open_rounds:
            s, p = r.round, r.fragment_id
            if s in self._answered or not self.ledger.can_answer(p) or self.feed.downloading(p):
                continue
            self._answered.add(s)
            snap = self._delta(p)
            header = self._header(p, s, inner_step)
            header.wait_s = round(max(0.0, now - (seen_at or {}).get(s, now)), 6)
            self.ledger.answer_sent(p, s)
            upload = guard(self.errors, "upload", self._upload)  # a bug: logged, counted, tokens outstanding
            self.uploads.append(pool.submit(upload, p, s, snap, header, report()))
            self.rounds_answered += 1
            self.metrics.rounds_answered.inc()

    def _delta(self, p: int) -> HostSnapshot:
        """p's parameters minus its anchor: queued on the device, copied to the host without stalling it."""
        anchors, copier, names = self.feed.anchors, self.feed.copier, self.layout.fragments[p].names
        values = self.feed.members.read(names)  # sharded: gathered from the ranks to the host
        with torch.no_grad():
            delta = {n: (values[n] - anchors[n]).float() for n in names}
        return copier.snapshot(delta, copy=False)

    def _header(self, p: int, round_: int, inner_step: int) -> UpdateHeader:
        books = self.ledger[p]
        return UpdateHeader(
            run_id=self.signer.run_id,
            kind="update",
            learner_id=self.learner_id,
            incarnation=self.incarnation,
            fragment_id=p,
            round=round_,
            base_version=books.anchor,
            c_steps=books.c_steps,
            c_tokens=books.c_tokens,
            c_seconds=books.c_seconds,
            inner_step=inner_step,
            codec=self.diloco.codec,
        )

    def _upload(
        self, p: int, s: int, snap: HostSnapshot, header: UpdateHeader, report: LearnerReport
    ) -> None:
        blob = pack_update(snap, header.codec, header.to_json(), self.signer)
        try:
            self.reports.write(
                report.to_json()
            )  # or a newer one is stored already, which names this answer too
            self.store.put(keys.update_key(p, s, self.learner_id, self.incarnation), blob)
        except StoreError as e:
            with self._lock:
                self.upload_failures += 1
            self.metrics.upload_failures.inc()
            if self.errors is not None:
                self.errors.store_error()
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

    def traffic(self) -> tuple[int, int, int]:
        """(bytes uploaded, bytes downloaded, failed uploads) so far, read consistently off the I/O threads."""
        with self._lock, self.feed.lock:
            return self.bytes_up, self.feed.bytes_down, self.upload_failures

    def wait_uploads(self, timeout: float = 30) -> None:
        """Wait for the uploads in flight (each at most `timeout` seconds), reading how each ended."""
        for fut in self.uploads:
            try:
                fut.result(timeout=timeout)
            except Exception as e:  # the upload thread logged and counted it (`guard`)
                log.debug("upload ended with %s", e)
        self.uploads = []

    def forget_finished_uploads(self) -> None:
        """Drop the finished uploads, reading each one's end: the thread logged and counted what it raised
        (`ddiloco.learner.health`); anything that still got through is logged here, never dropped."""
        running = []
        for fut in self.uploads:
            if not fut.done():
                running.append(fut)
            elif fut.exception() is not None:
                log.error("learner %d: upload ended with %r", self.learner_id, fut.exception())
        self.uploads = running
