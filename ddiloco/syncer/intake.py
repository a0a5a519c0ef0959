"""The syncer's intake: reading learner updates from the store, validating them and counting rejections.

`Intake.collect` reads each new object of an open round once; reader threads fetch, verify and check the next
answers while the loop adds the previous one to the round's sums, and an accepted answer is kept encoded
(`ddiloco.codec.encoded`). The rules and reasons are `ddiloco.protocol.validation`'s; the validator adds what
needs the syncer's fragments (staleness, base times, retention's `pruned_base`) and the claim bounds of
`ddiloco.protocol.claims`, each step credited once per fragment on the loop's thread. A rejected name is
re-read at most once a second and counted again only if its bytes changed. A rejection that authentically
names a learner incarnation and this round is told to that learner through the status object's bounded
`rejections` list; leftovers under a closed round are deleted after its fragment's next merge.

Design notes: docs/internals.md, "The intake".
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import math
import struct
import threading
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping, Sequence, Set
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from ddiloco import keys
from ddiloco.codec.base import chunk_buffer
from ddiloco.config.run import RunConfig
from ddiloco.protocol import claims, validation, wire
from ddiloco.protocol.messages import Merged, Rejection, RoundRecord
from ddiloco.run.globalmodel import Layout
from ddiloco.store.base import NotFound, ObjectTooLarge, Store, StoreError
from ddiloco.store.blob import Lend
from ddiloco.syncer.fragment import GlobalFragment
from ddiloco.syncer.rounds import Answer, Round
from ddiloco.tracking.metrics import SyncerMetrics

log = logging.getLogger(__name__)

REREAD_REJECTED_S = 1.0
MAX_NOTICES = 64


MEASURE_IN_READERS_FROM = 3
"""Readers measure the answers' norms (so the merge's pass only adds) from this many syncer threads on.
Below it the merge measures them in its own pass against the learner's claim (`ddiloco.codec.encoded`): that
costs the loop's thread ~0.11 s more per round at the 1b preset (16 int4 answers) but saves ~0.3 CPU-s, a
reader's separate pass; with two threads on two cores every CPU-second is on the critical path (1b, 24
fragments: 0.57 → 0.62 rounds/s in one A/B run of `benchmarks/syncer_scale.py`; docs/results.md §14.1); with a third the
loop's thread is."""


def split_threads(threads: int) -> tuple[int, int]:
    """(readers, merge threads) for a syncer given `threads` CPU threads. Readers fetch and verify answers
    (SHA-256 and HMAC, ~2 GB/s of encoded bytes per thread) while the loop merges the previous one with
    the torch threads (decode and add, ~9 GB/s of decoded fp32 per thread, i.e. about a core per reader at
    int4): half each, and no reader at all on one thread (reads then run inline, between merges)."""
    readers = max(1, threads) // 2
    return readers, max(1, threads - readers)


class UpdateValidator:
    """Turns the bytes of one update into an `Answer`, or raises PayloadError naming the reason."""

    def __init__(
        self,
        cfg: RunConfig,
        layout: Layout,
        fragments: Sequence[GlobalFragment],
        *,
        signer: wire.RunSigner,
        wall: Callable[[], float],
        retained: Callable[[int, int, int], bool] | None = None,
        run_start: float | None = None,
    ) -> None:
        """`retained(p, version, latest)`: whether the store keeps that base (`Retention.keeps`; None: all).
        `run_start`: `prepared_at` of the run (the base time of versions this syncer did not publish,
        `ddiloco.protocol.claims`; None: the syncer's start)."""
        self.retained = retained
        self.run_id, self.codec, self.layout, self.fragments = cfg.run_id, cfg.diloco.codec, layout, fragments
        self.max_staleness = cfg.diloco.max_staleness
        self.tokens_per_step = cfg.train.max_batch() * cfg.model.seq_len
        t = cfg.train
        self.limits = claims.Limits(
            cfg.model.seq_len,
            tuple(t.learner_batch_sizes or ()),
            t.batch_size,
            t.ranks,
            sum(f.numel for f in layout.fragments),
        )
        self.signer, self.wall = signer, wall
        self.run_start = (wall() if run_start is None else run_start) - claims.CLOCK_SKEW_S
        self.earlier: dict[tuple[int, int], float] = {}
        """(fragment, version) -> base time of a version an earlier syncer published (`learn_base_times`)."""
        self.pace = claims.Pace()
        """The learners' cadences, replaced by the syncer after each roster refresh (`Roster.pace`)."""
        self.step_clock = validation.StepClock()
        self.coverage = claims.Coverage()
        """The inner steps merged per incarnation and fragment (`claims.Coverage`; checked by `Intake`)."""

    def base_time(self, frag: GlobalFragment, version: int) -> float:
        """When version `version` of `frag` became available at the earliest, on this syncer's clock: its
        publish time, the merge time an earlier syncer recorded for it (`learn_base_times`), or the run's
        start (`claims`)."""
        published = frag.published_at.get(version)
        if published is None:
            published = self.earlier.get((frag.fragment_id, version))
        return published if published is not None else self.run_start

    def learn_base_times(self, store: Store, merged: Iterable[Merged]) -> None:
        """Base times of the versions an earlier syncer published, for the newest version of each fragment:
        the `merged_at` of its round record (taken before it was published, on that syncer's clock, so
        moved `claims.CLOCK_SKEW_S` earlier). One small read per fragment; a record that cannot be read
        leaves the run's start."""
        newest = {(f.fragment_id, f.version) for f in self.fragments if f.version not in f.published_at}
        for m in merged:
            if (m.fragment_id, m.version) not in newest:
                continue
            key = keys.round_record_key(m.round)
            try:
                t = RoundRecord.from_json(store.get_json(key), key).merged_at
            except (StoreError, ValueError) as e:
                log.debug("round record %d unreadable (%s)", m.round, e)
                continue
            if math.isfinite(t):
                self.earlier[(m.fragment_id, m.version)] = max(t - claims.CLOCK_SKEW_S, self.run_start)

    def max_bytes(self, p: int) -> int:
        # An fp32 delta is the largest legitimate update: twice that (plus header room) is never honest.
        return 2 * 4 * self.layout.fragments[p].numel + (1 << 20)

    def answer(
        self, rnd: Round, name: str, blob: bytes | memoryview, measure: torch.Tensor | None = None
    ) -> Answer:
        """Validate one update of `rnd` stored under `name` (rules: `ddiloco.protocol.validation`). A
        PayloadError raised after the sender is known carries it as `sender` (learner id, incarnation).
        `measure`: a decode buffer (`chunk_buffer`) to measure the norms with, in the pass that checks the
        codes (a reader's share, so the merge's pass only adds); None: the merge measures them."""
        frag = self.fragments[rnd.fragment_id]
        lent = isinstance(blob, memoryview) and not blob.readonly  # the tensors may be views of it
        h = self.signer.unpack(blob, {"kind": "update", "fragment_id": rnd.fragment_id}, borrow=lent)
        header = validation.header_fields(h.meta)
        named = keys.parse_update_name(name)
        if named is None:
            raise wire.PayloadError("malformed", f"{name[:80]!r} is not an update name")
        validation.identity(header, named, rnd.round)
        contributor = keys.contributor(*named)
        try:
            validation.counters(
                header, codec=self.codec, tokens_per_step=self.tokens_per_step, latest_version=frag.version
            )
            validation.staleness(header, latest_version=frag.version, max_staleness=self.max_staleness)
            base = header.base_version
            if self.retained is not None and not self.retained(rnd.fragment_id, base, frag.version):
                raise wire.PayloadError(
                    "pruned_base",
                    f"base version {base} is older than the versions kept (latest {frag.version})",
                )
            now, base_time, pace = self.wall(), self.base_time(frag, base), self.pace
            self.step_clock.check(contributor, header, base_time, now)
            tps = claims.tokens_per_step(header, self.limits)
            age = claims.allowed_age(now, claims.since(base_time, contributor, pace, now))
            claims.steps(header, age=age, tps=tps, limits=self.limits, pace=pace, who=contributor)
            names = self.layout.fragments[rnd.fragment_id].names
            encoded = validation.check_delta(
                h.tensors, header.codec, names, self.layout.shapes, measure=measure is not None, buf=measure
            )
        except wire.PayloadError as e:
            e.sender = named  # type: ignore[attr-defined]
            raise
        self.step_clock.record(contributor, header)
        return Answer(contributor, header, None, encoded=encoded)

    def decode(
        self, rnd: Round, blob: bytes, out: Mapping[str, torch.Tensor] | None = None
    ) -> dict[str, torch.Tensor]:
        """The fp32 δ of an update `answer` accepted before (verified again, counters not re-checked), into
        `out` when given."""
        h = self.signer.unpack(blob, {"kind": "update", "fragment_id": rnd.fragment_id})
        names = self.layout.fragments[rnd.fragment_id].names
        return validation.decode_delta(
            h.tensors, validation.header_fields(h.meta).codec, names, self.layout.shapes, out
        )


def _fresh(size: int) -> memoryview:
    """Memory of its own for one update (`Store.get_into`): its tensors are views of it, not copies made by
    the parser (an int4 answer of the 1b preset is 25.6 MB), and it lives as long as they do."""
    return memoryview(bytearray(size))


def accepted_digest(blob: bytes | memoryview) -> str:
    """Identifies the bytes of a payload that `wire.unpack` accepted: the SHA-256 of its header, which holds
    the SHA-256 of the data region that unpack checked, so hashing the (large) data again is not needed.
    Rejected bytes are identified by the SHA-256 of all of them (their header may not vouch for the data)."""
    (hlen,) = struct.unpack("<Q", blob[:8])
    return "header:" + hashlib.sha256(memoryview(blob)[: 8 + hlen]).hexdigest()


@dataclass(slots=True)
class _Read:
    """What a worker made of one update object: an answer, a rejection, or the same rejected bytes."""

    digest: str
    answer: Answer | None = None
    error: wire.PayloadError | None = None
    unchanged: bool = False


class Intake:
    """Reads, validates and files the updates of open rounds; counts and reports what it rejects."""

    def __init__(
        self,
        store: Store,
        validator: UpdateValidator,
        metrics: SyncerMetrics,
        *,
        clock: Callable[[], float],
        wall: Callable[[], float],
        on_notice: Callable[[], None],
        accept: Callable[[Round, Answer], None] | None = None,
        threads: int = 1,
    ) -> None:
        """`accept(rnd, answer)`: called for each valid answer before it is filed (the syncer adds it to the
        round's running sums and drops its delta); a ValueError from it rejects the answer. `threads`: the
        syncer's CPU threads; `split_threads` says how many of them read ahead (none on one thread)."""
        self.store, self.validator, self.metrics = store, validator, metrics
        self.workers, _ = split_threads(threads)
        self.measure = self.workers > 0 and threads >= MEASURE_IN_READERS_FROM
        self.accept = accept
        self.pool = ThreadPoolExecutor(self.workers, "intake") if self.workers > 0 else None
        self._buffers = threading.local()  # a decode buffer per reader
        self.clock, self.wall, self.on_notice = clock, wall, on_notice
        self.rejected: Counter[str] = Counter()
        self.notices: deque[Rejection] = deque(maxlen=MAX_NOTICES)
        self.late_answers = 0

    def state_dict(self) -> dict[str, Any]:
        """The run-long counts of rejections and late answers, and the steps credited per incarnation and
        fragment (`ddiloco.stateful.Stateful`)."""
        credited = self.validator.coverage.state_dict()
        return {
            "rejected": dict(self.rejected),
            "late_answers": self.late_answers,
            "credited_steps": credited,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.rejected, self.late_answers = Counter(state["rejected"]), state["late_answers"]
        self.validator.coverage.load_state_dict(state.get("credited_steps") or {})

    def collect(self, rnd: Round) -> None:
        """File every new valid update of `rnd` in `rnd.answers`; count and note the rest.

        With a pool, up to `threads` updates are fetched and verified at once (I/O, hashing and the checks
        release the GIL); they are accepted and filed one by one in listing order, so the running sums add
        the same answers in the same order whatever the threads did."""
        prefix = keys.update_prefix(rnd.fragment_id, rnd.round)
        now = self.clock()
        todo = []
        for key in self.store.list(prefix):
            name = key[len(prefix) :]
            retry = rnd.retry.get(name)
            if name not in rnd.seen and (retry is None or now >= retry[0]):
                todo.append((key, name))
        if self.pool is None:
            for key, name in todo:
                read = self._read(rnd, key, name)
                if read is not None:
                    self._file(rnd, key, name, read, now)
            return
        # A window of `workers` reads in flight: at most that many encoded answers wait at once, and the
        # next ones are fetched and verified while this thread adds the current one to the sums.
        pending: deque = deque()
        ahead = iter(todo)
        for key, name in itertools.islice(ahead, self.workers):
            pending.append((key, name, self.pool.submit(self._read, rnd, key, name)))
        while pending:
            key, name, future = pending.popleft()
            nxt = next(ahead, None)
            if nxt is not None:
                pending.append((*nxt, self.pool.submit(self._read, rnd, *nxt)))
            read = future.result()
            if read is not None:
                self._file(rnd, key, name, read, now)

    def _read(self, rnd: Round, key: str, name: str) -> _Read | None:
        """Fetch, verify and decode one update (a worker's share); None when it is gone or unchanged."""
        retry = rnd.retry.get(name)
        try:
            blob = self._fetch(rnd, key, _fresh)
        except wire.PayloadError as e:  # too large to read: the size stands in for its content
            return _Read("too_large", unchanged=retry is not None and retry[1] == "too_large", error=e)
        except NotFound:
            return None
        digest = hashlib.sha256(blob).hexdigest() if retry is not None else None
        if retry is not None and retry[1] == digest:  # the same rejected bytes: nothing new
            return _Read(digest, unchanged=True)
        # a reader measures the norms as it checks the codes, so the merge's pass only adds
        buf = self._buffers.__dict__.setdefault("buf", chunk_buffer()) if self.measure else None
        try:
            ans = self.validator.answer(rnd, name, blob, measure=buf)
        except wire.PayloadError as e:
            return _Read(digest or hashlib.sha256(blob).hexdigest(), error=e)
        return _Read(accepted_digest(blob), answer=ans)

    def _file(self, rnd: Round, key: str, name: str, read: _Read, now: float) -> None:
        if read.unchanged:
            rnd.retry[name] = (now + REREAD_REJECTED_S, read.digest)
            return
        try:
            if read.error is not None:
                raise read.error
            assert read.answer is not None
            ans = read.answer
            ans.key, ans.digest = key, read.digest
            try:  # here, in listing order on one thread: two answers read at once cannot both pass
                self.validator.coverage.check(ans.contributor, ans.header)
            except wire.PayloadError as e:
                e.sender = keys.parse_update_name(name)  # type: ignore[attr-defined]
                raise
            if self.accept is not None:
                self._accept(rnd, ans)
            self.validator.coverage.accepted(ans.contributor, ans.header)
        except wire.PayloadError as e:
            self._reject(rnd, key, name, e)
            rnd.retry[name] = (now + REREAD_REJECTED_S, read.digest)
            return
        rnd.retry.pop(name, None)
        rnd.seen.add(name)
        ans.arrived_s = now - rnd.opened_at
        rnd.answers[ans.contributor] = ans

    def _accept(self, rnd: Round, ans: Answer) -> None:
        assert self.accept is not None
        try:
            self.accept(rnd, ans)
        except ValueError as e:  # the merge's own checks (names, shapes, finite values)
            err = wire.PayloadError("malformed", str(e))
            err.sender = keys.parse_update_name(ans.key.rsplit("/", 1)[-1])  # type: ignore[attr-defined]
            raise err from None

    def reread(
        self, rnd: Round, contributor: str, out: Mapping[str, torch.Tensor] | None = None
    ) -> dict[str, torch.Tensor]:
        """An accepted answer's δ read and decoded again (its bytes must be the ones accepted), into `out`
        when given (`ddiloco.syncer.merge.accumulate.Reread`)."""
        ans = rnd.answers[contributor]
        blob = self._fetch(rnd, ans.key)
        if accepted_digest(blob) != ans.digest:
            raise wire.PayloadError("changed", f"{ans.key} changed after it was accepted")
        return self.validator.decode(rnd, blob, out)

    def _fetch(self, rnd: Round, key: str, lend: Lend | None = None) -> bytes | memoryview:
        """The update's bytes; into `lend`'s memory when given (the answer's tensors are then views of it)."""
        limit = self.validator.max_bytes(rnd.fragment_id)
        try:
            if lend is not None:
                return self.store.get_into(key, lend, max_bytes=limit)
            return self.store.get(key, max_bytes=limit)
        except ObjectTooLarge as e:
            raise wire.PayloadError("too_large", str(e)) from None

    def _count(self, reason: str) -> None:
        self.rejected[reason] += 1
        self.metrics.rejected.labels(reason=reason).inc()

    def _reject(self, rnd: Round, key: str, name: str, e: wire.PayloadError) -> None:
        self._count(e.reason)
        rnd.rejected[name] = e.reason
        log.warning("syncer: rejected %s (%s)", key, e)
        sender = getattr(e, "sender", None)
        if sender is not None:  # an authentic update of a known learner incarnation for this round
            self.notices.append(Rejection(*sender, rnd.fragment_id, rnd.round, e.reason, self.wall()))
            self.on_notice()

    def sweep_late(self, p: int, open_rounds: Set[int], merged: Mapping[int, Set[str]]) -> None:
        """Delete what is left under fragment p's closed rounds (answers that arrived after their round
        closed: their learners count them as discarded). `open_rounds`: p's open rounds; `merged`: round
        -> contributors merged in it, for p's recent merges.

        An update filed under a round that merged that very learner incarnation is a re-upload of an
        already merged answer (a replay), and junk that is no update key is malformed: both are counted
        as rejections."""
        for key in self.store.list(keys.fragment_updates_prefix(p)):
            parts = key.split("/")
            round_ = int(parts[2]) if len(parts) == 4 and parts[2].isdigit() else None
            if round_ in open_rounds:
                continue
            named = keys.parse_update_name(parts[-1]) if round_ is not None else None
            if named is None or keys.contributor(*named) in merged.get(round_, set()):
                reason = "malformed" if named is None else "replay"
                self._count(reason)
                log.warning("syncer: rejected %s (%s: its round is closed)", key, reason)
            else:
                self.late_answers += 1
            self.store.delete(key)
