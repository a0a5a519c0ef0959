"""A learner incarnation's token books, per fragment: pure bookkeeping, no store, no tensors.

Design choices:
- Every inner step counts for every fragment (each fragment's parameters took the step), so per fragment p
  the books balance exactly: tokens processed by this incarnation = merged + discarded + outstanding, where
  outstanding is `c_tokens`, the tokens since p's anchor (the global version last received).
- An answer carries p's counters at the time it was sent (`PendingAnswer`); steps taken after it keep
  counting. When a new version of p is applied the counters settle: the pending answer's tokens are merged
  if the syncer credited it (`ddiloco.protocol.messages.credited`, decided by the caller), and everything
  else since the anchor is discarded (the version overwrote it).
- A pending answer the syncer rejected, or whose round closed without a merge, is dropped without settling:
  its tokens stay outstanding and go into the next answer for that fragment.
- The per-fragment record is the report's schema (`ddiloco.protocol.learner_report.FragmentBooks`), so what the
  summary reads is exactly what the ledger keeps, and both settle it by one rule (`FragmentBooks.settled`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

from ddiloco.protocol.learner_report import FragmentBooks, PendingAnswer

__all__ = ["FragmentLedger", "Settled"]


@dataclass(frozen=True, slots=True)
class Settled:
    """Tokens one settlement moved out of a fragment's outstanding count."""

    merged: int = 0
    discarded: int = 0


class FragmentLedger:
    """The books of fragments 0..P-1 of one learner incarnation, and its totals."""

    def __init__(self, num_fragments: int) -> None:
        self.books = [FragmentBooks() for _ in range(num_fragments)]
        self.tokens_processed = 0
        self.busy_seconds = 0.0

    def __getitem__(self, p: int) -> FragmentBooks:
        return self.books[p]

    def __iter__(self) -> Iterator[FragmentBooks]:
        return iter(self.books)

    def __len__(self) -> int:
        return len(self.books)

    # --- work ---------------------------------------------------------------------------------------------
    def stepped(self, tokens: int, seconds: float) -> None:
        """One inner step of `tokens` tokens (all ranks) in `seconds` of compute."""
        self.tokens_processed += tokens
        self.busy_seconds += seconds
        for b in self.books:
            b.c_steps += 1
            b.c_tokens += tokens
            b.c_seconds += seconds

    # --- answers ------------------------------------------------------------------------------------------
    def can_answer(self, p: int) -> bool:
        """Whether p has steps to send and no answer whose fate is still unknown."""
        b = self.books[p]
        return b.pending is None and b.c_steps >= 1

    def answer_sent(self, p: int, round_: int) -> PendingAnswer:
        """p answered `round_` with its counters as they are now; returns the pending answer."""
        b = self.books[p]
        b.pending = PendingAnswer(round_, b.c_tokens, b.c_seconds, b.c_steps)
        return b.pending

    def pending_rounds(self) -> dict[int, int]:
        """round -> fragment, for every answer in flight."""
        return {b.pending.round: p for p, b in enumerate(self.books) if b.pending is not None}

    def drop_pending(self, p: int, round_: int) -> bool:
        """The answer to `round_` will never be merged (rejected, or its round closed without a merge): its
        tokens stay outstanding. False if p has no pending answer to that round."""
        b = self.books[p]
        if b.pending is None or b.pending.round != round_:
            return False
        b.pending = None
        return True

    # --- settlement ---------------------------------------------------------------------------------------
    def applied(self, p: int, version: int, credited: bool) -> Settled:
        """Global `version` of p overwrote the learner's copy: the pending answer's tokens are merged when
        `credited`, the rest since the anchor is discarded, and the counters restart at `version`."""
        settled = self._settle(p, credited)
        self.books[p].anchor = version
        return settled

    def settle_final(self, p: int, credited: bool) -> Settled:
        """The run is over: as `applied`, keeping the anchor (no version follows)."""
        return self._settle(p, credited)

    def _settle(self, p: int, credited: bool) -> Settled:
        before = self.books[p]
        after = self.books[p] = before.settled(credited, final=True)
        return Settled(
            after.merged_tokens - before.merged_tokens, after.discarded_tokens - before.discarded_tokens
        )

    # --- what the report and the checks read -----------------------------------------------------------
    def balanced(self) -> bool:
        """processed = merged + discarded + outstanding, for every fragment."""
        return all(
            self.tokens_processed == b.merged_tokens + b.discarded_tokens + b.c_tokens for b in self.books
        )

    def snapshot(self) -> dict[str, FragmentBooks]:
        """The report's `fragments` ({"<p>": books}), copied: the report is written later, off the loop."""
        return {str(p): replace(b) for p, b in enumerate(self.books)}
