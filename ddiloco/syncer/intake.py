"""The syncer's intake: reading learner updates from the store, validating them and counting rejections.

Design choices:
- `Intake.collect` reads each new object of an open round once; what `UpdateValidator` accepts is decoded
  to an fp32 delta, so a merge only does arithmetic. The rules and reasons live in
  `ddiloco.protocol.validation`; the validator adds the checks that need the syncer's fragments (the
  newest version, when a base was published, whether a base can be read).
- An answer whose base the retention rules no longer keep is `pruned_base` (`ddiloco.syncer.retention`), decided
  from the rule, not from whether the object is still there, so the verdict never races the pruning.
- A name whose object was rejected is re-read at most once a second, and only counted again if its bytes
  changed, so junk written first under a learner's key cannot block that learner's real answer.
- A rejection whose header authentically names a learner incarnation and this round is told to that
  learner through a bounded `rejections` list in the status object (it then knows its tokens stay
  outstanding): the intake keeps the list and calls `on_notice` so the syncer publishes it. Objects that
  cannot be attributed are only counted.
- An update filed under a round that has already merged that learner incarnation is a replay; whatever is
  left under a closed round is deleted after the next merge of its fragment (`sweep_late`).
"""

from __future__ import annotations

import hashlib
import logging
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence, Set

from ddiloco import keys
from ddiloco.config import RunConfig
from ddiloco.globalmodel import Layout
from ddiloco.metrics import SyncerMetrics
from ddiloco.protocol import validation, wire
from ddiloco.protocol.messages import Rejection
from ddiloco.store.base import NotFound, ObjectTooLarge, Store
from ddiloco.syncer.fragment import GlobalFragment
from ddiloco.syncer.rounds import Answer, Round

log = logging.getLogger(__name__)

REREAD_REJECTED_S = 1.0
MAX_NOTICES = 64


class UpdateValidator:
    """Turns the bytes of one update into an `Answer`, or raises PayloadError naming the reason."""

    def __init__(
        self,
        cfg: RunConfig,
        layout: Layout,
        fragments: Sequence[GlobalFragment],
        *,
        key: bytes | None,
        wall: Callable[[], float],
        retained: Callable[[int, int, int], bool] | None = None,
    ) -> None:
        """`retained(p, version, latest)`: whether the store keeps that base (`Retention.keeps`; None: all)."""
        self.retained = retained
        self.run_id, self.codec, self.layout, self.fragments = cfg.run_id, cfg.diloco.codec, layout, fragments
        self.tokens_per_step = cfg.train.max_batch() * cfg.model.seq_len
        self.key, self.wall = key, wall
        self.step_clock = validation.StepClock()

    def max_bytes(self, p: int) -> int:
        # An fp32 delta is the largest legitimate update: twice that (plus header room) is never honest.
        return 2 * 4 * self.layout.fragments[p].numel + (1 << 20)

    def answer(self, rnd: Round, name: str, blob: bytes) -> Answer:
        """Validate one update of `rnd` stored under `name` (rules: `ddiloco.protocol.validation`). A
        PayloadError raised after the sender is known carries it as `sender` (learner id, incarnation)."""
        frag = self.fragments[rnd.fragment_id]
        h = wire.unpack(
            blob,
            expect={"run_id": self.run_id, "kind": "update", "fragment_id": rnd.fragment_id},
            key=self.key,
        )
        meta = h.meta
        validation.header_fields(meta)
        named = keys.parse_update_name(name)
        if named is None:
            raise wire.PayloadError("malformed", f"{name[:80]!r} is not an update name")
        validation.identity(meta, named, rnd.round)
        contributor = keys.contributor(*named)
        try:
            validation.counters(
                meta, codec=self.codec, tokens_per_step=self.tokens_per_step, latest_version=frag.version
            )
            base = meta["base_version"]
            if self.retained is not None and not self.retained(rnd.fragment_id, base, frag.version):
                raise wire.PayloadError(
                    "pruned_base",
                    f"base version {base} is older than the versions kept (latest {frag.version})",
                )
            published = frag.published_at.get(meta["base_version"])
            self.step_clock.check(contributor, meta, published, self.wall())
            try:
                frag.base(meta["base_version"])
            except (wire.PayloadError, NotFound) as e:
                raise wire.PayloadError(
                    "bad_base", f"base version {meta['base_version']} unreadable ({e})"
                ) from None
            names = self.layout.fragments[rnd.fragment_id].names
            delta = validation.decode_delta(h.tensors, meta["codec"], names, self.layout.shapes)
        except wire.PayloadError as e:
            e.sender = named  # type: ignore[attr-defined]
            raise
        self.step_clock.record(contributor, meta)
        return Answer(contributor, meta, delta)


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
        rejected: Mapping[str, int] | None = None,
        late_answers: int = 0,
    ) -> None:
        self.store, self.validator, self.metrics = store, validator, metrics
        self.clock, self.wall, self.on_notice = clock, wall, on_notice
        self.rejected: Counter[str] = Counter(rejected or {})
        self.notices: deque[Rejection] = deque(maxlen=MAX_NOTICES)
        self.late_answers = late_answers

    def collect(self, rnd: Round) -> None:
        """File every new valid update of `rnd` in `rnd.answers`; count and note the rest."""
        prefix = keys.update_prefix(rnd.fragment_id, rnd.round)
        now = self.clock()
        for key in self.store.list(prefix):
            name = key[len(prefix) :]
            retry = rnd.retry.get(name)
            if name in rnd.seen or (retry is not None and now < retry[0]):
                continue
            try:
                blob: bytes | None = self._fetch(rnd, key)
                digest = hashlib.sha256(blob).hexdigest()
            except wire.PayloadError as e:  # too large to read: the size stands in for its content
                blob, digest, too_large = None, "too_large", e
            except NotFound:
                continue
            if retry is not None and retry[1] == digest:  # the same rejected bytes: nothing new
                rnd.retry[name] = (now + REREAD_REJECTED_S, digest)
                continue
            try:
                if blob is None:
                    raise too_large
                ans = self.validator.answer(rnd, name, blob)
            except wire.PayloadError as e:
                self._reject(rnd, key, name, e)
                rnd.retry[name] = (now + REREAD_REJECTED_S, digest)
                continue
            rnd.retry.pop(name, None)
            rnd.seen.add(name)
            rnd.answers[ans.contributor] = ans

    def _fetch(self, rnd: Round, key: str) -> bytes:
        try:
            return self.store.get(key, max_bytes=self.validator.max_bytes(rnd.fragment_id))
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
