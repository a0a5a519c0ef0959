"""The syncer's intake: reading learner updates from the store, validating them and counting rejections.

Design choices:
- `collect` reads each new object of an open round once; what it accepts is decoded to an fp32 delta, so
  a merge only does arithmetic. The rules and reasons live in `ddiloco.protocol.validation`.
- A name whose object was rejected is re-read at most once a second, and only counted again if its bytes
  changed, so junk written first under a learner's key cannot block that learner's real answer.
- A rejection whose header authentically names a learner incarnation and this round is told to that
  learner through a bounded `rejections` list in the status object (it then knows its tokens stay
  outstanding). Objects that cannot be attributed are only counted.
- An update filed under a round that has already merged that learner incarnation is a replay; whatever is
  left under a closed round is deleted after the next merge of its fragment.
- This is a mixin of `Syncer` (it uses the syncer's store, layout, key, counters and metrics): one file per
  responsibility, one object at run time.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from ddiloco import keys
from ddiloco.protocol import validation, wire
from ddiloco.store import NotFound, ObjectTooLarge

log = logging.getLogger(__name__)

REREAD_REJECTED_S = 1.0


@dataclass(slots=True)
class Answer:
    contributor: str
    header: dict[str, Any]
    delta: dict[str, torch.Tensor]  # fp32, relative to the learner's base version


@dataclass(slots=True)
class Round:
    round: int
    fragment_id: int
    opened_at: float
    opened_wall: float
    quorum_at: float | None = None
    grace_s: float = 0.0
    seen: set[str] = field(default_factory=set)
    answers: dict[str, Answer] = field(default_factory=dict)
    rejected: dict[str, str] = field(default_factory=dict)
    retry: dict[str, tuple[float, str]] = field(default_factory=dict)
    """Rejected names: (when to look again, digest of the rejected bytes)."""


class Intake:
    """Update intake of the syncer (see the module docstring); needs the attributes `Syncer` sets."""

    def collect(self, rnd: Round) -> None:
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
                ans = self._load_answer(rnd, name, blob)
            except wire.PayloadError as e:
                self._reject(rnd, key, name, e)
                rnd.retry[name] = (now + REREAD_REJECTED_S, digest)
                continue
            rnd.retry.pop(name, None)
            rnd.seen.add(name)
            self.step_clock.record(ans.contributor, ans.header)
            rnd.answers[ans.contributor] = ans

    def _reject(self, rnd: Round, key: str, name: str, e: wire.PayloadError) -> None:
        self.rejected[e.reason] += 1
        self.metrics.rejected.labels(reason=e.reason).inc()
        rnd.rejected[name] = e.reason
        log.warning("syncer: rejected %s (%s)", key, e)
        sender = getattr(e, "sender", None)
        if sender is not None:  # an authentic update of a known learner incarnation for this round
            self.notices.append(
                {"learner_id": sender[0], "incarnation": sender[1], "fragment_id": rnd.fragment_id,
                 "round": rnd.round, "reason": e.reason, "time": self.wall()}
            )  # fmt: skip
            self.publish_status()

    def _fetch(self, rnd: Round, key: str) -> bytes:
        # An fp32 delta is the largest legitimate update: twice that (plus header room) is never honest.
        frag = self.layout.fragments[rnd.fragment_id]
        try:
            return self.store.get(key, max_bytes=2 * 4 * frag.numel + (1 << 20))
        except ObjectTooLarge as e:
            raise wire.PayloadError("too_large", str(e)) from None

    def _load_answer(self, rnd: Round, name: str, blob: bytes) -> Answer:
        """Validate one update (rules and reasons: `ddiloco.protocol.validation`); PayloadError if it is rejected."""
        p = rnd.fragment_id
        h = wire.unpack(
            blob, expect={"run_id": self.run_id, "kind": "update", "fragment_id": p}, key=self.key
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
                meta,
                codec=self.cfg.diloco.codec,
                tokens_per_step=self.tokens_per_step,
                latest_version=self.versions[p],
            )
            published = self.published_at.get((p, meta["base_version"]))
            self.step_clock.check(contributor, meta, published, self.wall())
            try:
                self._base(p, meta["base_version"])
            except (wire.PayloadError, NotFound) as e:
                raise wire.PayloadError(
                    "bad_base", f"base version {meta['base_version']} unreadable ({e})"
                ) from None
            delta = validation.decode_delta(
                h.tensors, meta["codec"], self.layout.fragments[p].names, self.layout.shapes
            )
        except wire.PayloadError as e:
            e.sender = named  # type: ignore[attr-defined]
            raise
        return Answer(contributor, meta, delta)

    def _sweep_late(self, p: int) -> None:
        """Delete answers that arrived after their round closed (their learners count them as discarded).

        An update filed under a round that merged that very learner incarnation is a re-upload of an
        already merged answer (a replay), and junk that is no update key is malformed: both are counted
        as rejections."""
        open_rounds = {r.round for r in self.open.values() if r.fragment_id == p}
        merged = {m["round"]: m["contributors"] for m in self.merged_recent if m["fragment_id"] == p}
        for key in self.store.list(f"updates/{p:03d}/"):
            parts = key.split("/")
            round_ = int(parts[2]) if len(parts) == 4 and parts[2].isdigit() else None
            if round_ in open_rounds:
                continue
            named = keys.parse_update_name(parts[-1]) if round_ is not None else None
            if named is None or keys.contributor(*named) in merged.get(round_, {}):
                reason = "malformed" if named is None else "replay"
                self.rejected[reason] += 1
                self.metrics.rejected.labels(reason=reason).inc()
                log.warning("syncer: rejected %s (%s: its round is closed)", key, reason)
            else:
                self.late_answers += 1
            self.store.delete(key)
