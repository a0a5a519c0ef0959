"""What a keeper tells the run while its worker waits to be scheduled: a small JSON document in the run's
store, `keeper/<role>[-<learner id>].json` (`ddiloco.keys.KEEPER`), that `ddiloco summary` shows under
`waiting` (the KFP task's own status message is not writable from inside the task).

Design choices:
- Written when the worker's Pending reason changes (e.g. `held by scheduling gates [...], waiting for Kueue
  to admit it (queue 'team-a')`), `{"worker", "waiting", "since"}`; once the worker runs or ends, rewritten
  with `waiting` empty, so a stale note never outlives the wait.
- Best effort: a store that cannot be written is logged as a warning; the keeper goes on keeping its worker.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from ddiloco import keys

log = logging.getLogger(__name__)


def slot_name(role: str, learner_id: int | None) -> str:
    return role if learner_id is None else f"{role}-{learner_id}"


class WaitNote:
    """`waiting(worker, why)` / `clear()` for one keeper's slot; `open_store()` is called at the first note."""

    def __init__(
        self, open_store: Callable[[], Any], name: str, clock: Callable[[], float] = time.time
    ) -> None:
        self._open, self._store, self.clock = open_store, None, clock
        self.key, self.noted = keys.keeper_note_key(name), False

    def waiting(self, worker: str, why: str) -> None:
        self._put({"worker": worker, "waiting": why, "since": self.clock()})
        self.noted = True

    def clear(self) -> None:
        if self.noted:
            self._put({"worker": "", "waiting": "", "since": self.clock()})
            self.noted = False

    def _put(self, doc: dict[str, Any]) -> None:
        try:
            if self._store is None:
                self._store = self._open()
            self._store.put_json(self.key, doc)
        except Exception as exc:  # noqa: BLE001 (a note is best effort: the worker matters, not the note)
            log.warning("could not write %s to the run's store: %s", self.key, " ".join(str(exc).split()))
