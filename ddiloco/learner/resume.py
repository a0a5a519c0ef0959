"""Where a restarted learner's data cursor resumes: after the last batch it reported as processed.

Design choices:
- Every report of a single-process learner carries its data cursor (`LearnerReport.cursor`, the loader's
  `state_dict()` after the last step the report counts). Reports are written at every heartbeat and
  before every upload, checkpoints only every few minutes, so a learner killed between two checkpoints
  resumes its data from its previous incarnation's last report, not from its checkpoint: no token it
  reported as processed is read again in the same epoch. Its model state comes from the checkpoint and the
  current globals; the tokens it trained on after that report were never counted and are read again.
- The newest incarnation before this one that reported a cursor wins (an incarnation that died before its
  first report is skipped). A cursor the loader refuses (another shard, another sequence length: a run
  re-prepared) or one behind the checkpoint's is ignored with a log line: the checkpoint's cursor stays.
- Under DDP each rank has its own cursor and only rank 0 reports; the ranks' cursors are gathered at
  checkpoints, which is where they resume from (`ddiloco.learner.ddp`).
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from ddiloco import keys
from ddiloco.store.base import Store

log = logging.getLogger(__name__)

MAX_REPORT_BYTES = 4 << 20


class Cursor(Protocol):
    """What a data loader offers for resuming (`ddiloco.data.loader.ShardLoader` and the streamed loaders)."""

    @property
    def epochs_read(self) -> float: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, d: dict) -> None: ...


def last_reported_cursor(store: Store, learner_id: int, incarnation: int) -> tuple[int, dict] | None:
    """(incarnation, cursor) of the newest earlier incarnation of `learner_id` whose report has a cursor."""
    for inc in range(incarnation - 1, -1, -1):
        doc = store.get_json_or_none(keys.report_key(learner_id, inc), max_bytes=MAX_REPORT_BYTES)
        cursor = (doc or {}).get("cursor")
        if isinstance(cursor, dict):
            return inc, cursor
    return None


def resume_from_reports(loader: Cursor, store: Store, learner_id: int, incarnation: int) -> dict[str, Any]:
    """Move `loader` to the last reported cursor when it is ahead of where it is (the checkpoint's cursor, or
    the start); returns what was done: {"from": "report"|"checkpoint", "incarnation", "epochs"}."""
    found = last_reported_cursor(store, learner_id, incarnation)
    kept = {"from": "checkpoint", "incarnation": None, "epochs": loader.epochs_read}
    if found is None:
        return kept
    inc, cursor = found
    before = loader.state_dict()
    try:
        loader.load_state_dict(cursor)
    except ValueError as e:
        log.warning(
            "learner %d: the cursor reported by incarnation %d is not resumed (%s)", learner_id, inc, e
        )
        loader.load_state_dict(before)
        return kept
    if loader.epochs_read < kept["epochs"]:
        loader.load_state_dict(before)  # the checkpoint is newer than that report
        return kept
    log.info(
        "learner %d: data resumes after the last batch incarnation %d reported (%.4f epochs)",
        learner_id,
        inc,
        loader.epochs_read,
    )
    return {"from": "report", "incarnation": inc, "epochs": loader.epochs_read}
