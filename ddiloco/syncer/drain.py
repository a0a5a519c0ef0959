"""The end of a run: every fragment gets one last round on what the learners trained since its last merge.

Design choices:
- Why: a fragment is merged every H steps, so when the budget is reached the learners hold, on each fragment,
  what they trained since its last round (on average H/2 steps of every learner). Finishing there threw that
  compute away: at 2.5M tokens on the tiny preset (H = 48, P = 4, M = 4) only ~90% of the processed tokens
  were ever merged, and the comparison with data-parallel is at equal *processed* tokens. The loss is a fixed
  number of steps per learner, so it costs the most at small budgets and little at large ones; a rule that
  depends on what it should depend on is one that wastes none of it.
- When the budget is reached (or the deadline passed) the syncer *closes*: its status says `closing`, it
  opens no round by the pacing rule, and learners stop stepping at their next step boundary while they keep
  answering rounds and applying versions (`Learner.tick`). A stopped learner's answers are final: nothing
  it does afterwards is lost.
- Every fragment without a round open at that moment gets one closing round, at most τ in flight (each
  holds two fragment-sized buffers: memory stays as in training), no pacing. A fragment whose round is open
  then needs none: the version that round publishes restarts every learner's counters on that fragment
  (`FragmentLedger.applied`), so no learner would have steps to answer a second one.
- While closing, every open round (a closing one or one opened before) merges as soon as every live
  learner answered; after its quorum it waits at least
  `wait_s` (answers of stopped learners arrive within a status poll and an upload: two transport times
  ξ_link plus four polls, at least a second). One with no answer by then is closed without a merge (no
  learner had steps on that fragment); one below the quorum K then is abandoned (the learners that did
  not answer had just applied a version: their counters restarted, they will never answer it), rather
  than held until `round_timeout_s`.
- A round merged while closing is its fragment's last move: by default (`diloco.closing_step: mean`) it
  moves the fragment to the learners' weighted mean, Θ_p − Δ with Δ the plain weighted mean of the answers
  (`RoundSums.finalize(plain=True)`, RDA tensors too), not by the outer Nesterov step
  (`OuterNesterov.step_to(final=True)`). The outer step's look-ahead (m²·buf, the momentum of earlier full
  rounds) pays off only when the learners train on from the moved point; at the end it overshoots, most on
  a round of few steps, where the look-ahead outweighs the round's own progress: at 40M tokens the closing
  rounds took three runs' validation loss up by 1.4%, 1.6% and 2.9% (docs/results.md §12.10). RDA's
  length (the answers' mean norm, 1/cos of their spread longer than their mean) overshoots the same way
  with nothing after it: without the momentum but with RDA, a run still lost 0.65%, and half that step
  did better than the whole.
- Closing rounds are left out of the pace figures (`ddiloco.syncer.pace`): the learners do not step while
  closing, so their overlap and sync period in steps mean nothing.
- Closing ends when every closing round closed and every publish was committed, or `round_timeout_s` after
  it began (what is still open is then closed unmerged, as at any finish). A syncer restarted while closing
  closes again from its books: learners that already answered have nothing left, and those rounds close
  empty after `wait_s`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from ddiloco.protocol.messages import ClosingFigures
from ddiloco.syncer.commit import close_round
from ddiloco.syncer.rounds import Round

log = logging.getLogger(__name__)

MIN_WAIT_S = 1.0
"""The least a closing round waits for the answers of stopped learners (seconds)."""


def merges_to_the_mean(syncer: Any) -> bool:
    """Whether the round `syncer` merges now is its fragment's last move and goes to the learners' weighted
    mean (`propose(final=True)`): the run is closing and `diloco.closing_step` is `mean` (module docstring)."""
    return syncer.closing is not None and syncer.cfg.diloco.closing_step == "mean"


@dataclass(slots=True)
class Closing:
    reason: str
    """Why the run ends: `budget` or `deadline` (`loop.finished_by`)."""
    began: float
    """The syncer's clock when closing began."""
    todo: list[int]
    """Fragments still to get their closing round, in round-robin order."""
    rounds: set[int] = field(default_factory=set)
    """The closing rounds opened so far."""
    merged: int = 0
    """Closing rounds merged (committed) so far."""
    merged_before: float = 0.0
    """Tokens merged when closing began (the summary says how many the closing rounds added)."""

    @classmethod
    def begin(cls, syncer: Any, reason: str, now: float) -> Closing:
        """Close the run (`syncer.closing`) and say so in the status, so learners stop stepping; closing
        rounds go to the fragments without an open round, from the next in round-robin order."""
        busy = {r.fragment_id for r in syncer.open.values()}
        first = syncer.books.next_round % syncer.P
        order = [(first + i) % syncer.P for i in range(syncer.P)]
        todo = [p for p in order if p not in busy]
        merged = syncer.tokens_merged()
        log.info(
            "syncer: closing (%s) at %d tokens merged: learners stop stepping; closing rounds for fragments "
            "%s (%s still open)",
            reason,
            merged,
            todo,
            sorted(busy),
        )
        syncer.closing = cls(reason, now, todo, merged_before=merged)
        syncer.publish_status()  # after `syncer.closing` is set: this status says `closing`
        return syncer.closing

    def wait_s(self, syncer: Any) -> float:
        """How long a closing round waits for answers (module docstring)."""
        d, b = syncer.cfg.diloco, syncer.books
        cap = d.grace.cap_seconds if d.grace is not None else 0.0
        return max(MIN_WAIT_S, 2 * min(b.xi_link, cap) + 4 * syncer.cfg.train.poll_every_s)

    def step(self, syncer: Any, now: float) -> bool:
        """The closing part of a syncer pass: True once closing finished, else open what may open."""
        if self.finished(syncer, syncer.clock()):
            return True
        self.open_next(syncer, now)
        return False

    def settle_short(self, syncer: Any, rnd: Round, now: float, wait_s: float) -> bool:
        """Close `rnd` if it is short and due (`is_short_and_due`): abandoned when it has answers, closed
        quietly when it has none. True if it was closed."""
        if not self.is_short_and_due(rnd, now, wait_s):
            return False
        if rnd.answers:
            syncer._abandon(rnd)
        else:
            close_round(syncer, rnd)
            syncer.publish_status()
        return True

    def open_next(self, syncer: Any, now: float) -> None:
        """Open the next closing rounds while fewer than τ rounds are in flight (none without a live
        learner: nobody would answer)."""
        if not syncer.roster.live():
            self.todo.clear()
        while self.todo and len(syncer.open) < syncer.cfg.diloco.overlap:
            p, b = self.todo.pop(0), syncer.books
            syncer.open[b.next_round] = Round(b.next_round, p, now, syncer.wall())
            self.rounds.add(b.next_round)
            b.next_round += 1
            syncer.publish_status()

    def is_short_and_due(self, rnd: Round, now: float, wait_s: float) -> bool:
        """An open round without its quorum `wait_s` after it opened and after closing began: no answer
        (nobody had steps on its fragment) or fewer than K (the others' counters restarted with a version:
        they have none to send, now that they do not step)."""
        return rnd.quorum_at is None and now - max(rnd.opened_at, self.began) >= wait_s

    def finished(self, syncer: Any, now: float) -> bool:
        """Every closing round closed and committed; or closing ran `round_timeout_s` (logged)."""
        if not self.todo and not syncer.open and not syncer.unpublished:
            return True
        if now - self.began > syncer.cfg.diloco.round_timeout_s:
            log.warning(
                "syncer: closing took over round_timeout_s=%ss; finishing with rounds %s open and fragments "
                "%s without a closing round",
                syncer.cfg.diloco.round_timeout_s,
                sorted(syncer.open),
                self.todo,
            )
            return True
        return False

    def figures(self, syncer: Any, now: float) -> ClosingFigures:
        """What the done marker says about closing: rounds, seconds, tokens it merged."""
        return ClosingFigures(
            closing_rounds=len(self.rounds),
            closing_rounds_merged=self.merged,
            closing_seconds=round(now - self.began, 3),
            closing_tokens_merged=syncer.tokens_merged() - self.merged_before,
        )
