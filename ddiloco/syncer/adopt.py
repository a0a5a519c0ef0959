"""What the syncer finds at a global version key: a version to adopt, its own retried write, a newer
writer's (fenced), or an object that does not verify (moved aside).

The global version is a publish's commit point and names its writer (`round`, `epoch`) in its signed header.
A starting syncer trusts neither the latest pointer nor its state: it probes past its state's version and
adopts each contiguous version that verifies and was written by an older epoch. `VersionSlots.inspect`
classifies what a publish finds: its own earlier attempt goes on, a newer epoch's (or this epoch's for another
round) is `Fenced`, an older epoch's that appears meanwhile is `Superseded` (adopted). An object that does
not verify is logged, counted, copied to `syncer/quarantine/` and deleted, and the syncer publishes that
version itself.

Design notes: docs/internals.md, "What a version key holds".
"""

from __future__ import annotations

import logging
import secrets
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ddiloco import keys
from ddiloco.protocol import wire
from ddiloco.protocol.messages import RoundRecord
from ddiloco.run.globalmodel import Layout, read_global_full
from ddiloco.run.root import RunRoot
from ddiloco.store.base import NotFound, ObjectTooLarge
from ddiloco.syncer.lease import Fenced

log = logging.getLogger(__name__)


class Superseded(Fenced):
    """The version this syncer was publishing was written, and verifies, by an older epoch meanwhile."""

    def __init__(self, p: int, version: int, epoch: int) -> None:
        super().__init__(
            f"global version {version} of fragment {p} was published by the older epoch {epoch} meanwhile"
        )
        self.fragment_id, self.version, self.epoch = p, version, epoch


@dataclass(frozen=True, slots=True)
class Written:
    """A global version that verifies, and who wrote it (its header's `epoch` and `round`)."""

    version: int
    epoch: int
    round: int | None


class VersionSlots:
    """The global version keys of one run as a publishing syncer sees them (module docstring)."""

    def __init__(self, root: RunRoot, layout: Layout) -> None:
        self.store, self.signer, self.layout = root.store, root.signer, layout
        self.quarantined: Counter[str] = Counter()
        """Objects found at a global version key that did not verify, moved aside, by reason."""

    def state_dict(self) -> dict[str, Any]:
        """The quarantine's counts (`ddiloco.stateful.Stateful`)."""
        return {"quarantined": dict(self.quarantined)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.quarantined = Counter(state["quarantined"])

    def inspect(self, p: int, version: int) -> Written | wire.PayloadError | None:
        """What is at fragment p's version key: nothing, a version that verifies, or why it does not."""
        try:
            got = read_global_full(self.store, self.signer, self.layout, p, version)
        except NotFound:
            return None
        except wire.PayloadError as e:
            return e
        epoch, round_ = got.meta.get("epoch", 0), got.meta.get("round")
        if not isinstance(epoch, int) or not (round_ is None or isinstance(round_, int)):
            return wire.PayloadError(
                "malformed", f"global v{version} of fragment {p} names no epoch or round"
            )
        return Written(version, epoch, round_)

    def ours(self, record: RoundRecord, version: int) -> bool:
        """Whether global `version` of the record's fragment is this publish's own earlier write (True) or
        free (False; an object there that does not verify is moved aside first); `Superseded` if an older
        epoch wrote it, `Fenced` if a newer one did or this epoch for another round."""
        p, epoch = record.fragment_id, record.epoch
        found = self.inspect(p, version)
        if found is None:
            return False
        if isinstance(found, wire.PayloadError):
            self.move_aside(p, version, found, epoch)
            return False
        if found.epoch == epoch and found.round == record.round:
            return True
        if found.epoch < epoch:
            raise Superseded(p, version, found.epoch)
        raise Fenced(
            f"global version {version} of fragment {p} was published by another syncer "
            f"(epoch {found.epoch}, round {found.round}; this is epoch {epoch}, round {record.round})"
        )

    def move_aside(
        self,
        p: int,
        version: int,
        why: wire.PayloadError,
        epoch: int | None,
        then: str = "publishing that version anyway",
    ) -> None:
        """Count, log and copy the unverifiable object at p's version key aside, then delete it; `then`:
        what the syncer does next (logged)."""
        self.quarantined[why.reason] += 1
        key = keys.global_key(p, version)
        aside = keys.quarantine_key(key, f"e{epoch or 0}-{secrets.token_hex(4)}")
        log.error(
            "syncer: the object at %s does not verify (%s); moving it to %s, %s",
            key,
            why,
            aside,
            then,
        )
        try:
            self.store.put(aside, self.store.get(key, max_bytes=self.layout.fragment_max_bytes(p)))
        except ObjectTooLarge:
            log.error("syncer: %s is larger than a fragment's payload; deleted without a copy", key)
        except NotFound:
            return
        self.store.delete(key)

    def adopt_after(self, p: int, version: int, epoch: int | None) -> tuple[int, list[RoundRecord]]:
        """Fragment p's versions after `version` that verify and were written by an epoch older than `epoch`
        (contiguous; an unverifiable object ends them and is moved aside): the newest, and the round records
        to credit (one per version, the round its header names). `Fenced` at one written by `epoch` or a
        newer one."""
        adopted: list[RoundRecord] = []
        while True:
            found = self.inspect(p, version + 1)
            if found is None:
                return version, adopted
            if isinstance(found, wire.PayloadError):
                self.move_aside(p, version + 1, found, epoch)
                return version, adopted
            if epoch is not None and found.epoch >= epoch:
                raise Fenced(
                    f"global version {found.version} of fragment {p} was written by epoch {found.epoch}, "
                    f"not older than this syncer's {epoch}"
                )
            version += 1
            log.warning(
                "syncer: adopting fragment %d version %d (epoch %d, round %s), published after the last "
                "state write",
                p,
                version,
                found.epoch,
                found.round,
            )
            rec = self._record_of(p, found)
            if rec is not None:
                adopted.append(rec)

    def _record_of(self, p: int, found: Written) -> RoundRecord | None:
        """The round record of an adopted version (written before it, by the same publish); None, logged,
        if it is missing or names another version: that version's tokens are then not credited."""
        doc = None if found.round is None else self.store.get_json_or_none(keys.round_record_key(found.round))
        try:
            rec = None if doc is None else RoundRecord.from_json(doc, keys.round_record_key(found.round))
        except ValueError as e:
            log.error("syncer: round record %s unreadable (%s)", found.round, e)
            return None
        if rec is None or rec.fragment_id != p or rec.version != found.version:
            log.error(
                "syncer: fragment %d version %d has no round record of its round %s; its tokens are not "
                "credited",
                p,
                found.version,
                found.round,
            )
            return None
        return rec
