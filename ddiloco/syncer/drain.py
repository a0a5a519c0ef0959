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
from collections.abc import Collection
from dataclasses import dataclass, field

from ddiloco.config.run import RunConfig
from ddiloco.protocol.messages import ClosingFigures
from ddiloco.syncer.rounds import Round

log = logging.getLogger(__name__)

MIN_WAIT_S = 1.0
"""The least a closing round waits for the answers of stopped learners (seconds)."""


def wait_s(cfg: RunConfig, xi_link: float) -> float:
    """How long a closing round waits for answers, with ξ_link the transport time measured so far (module
    docstring)."""
    d = cfg.diloco
    cap = d.grace.cap_seconds if d.grace is not None else 0.0
    return max(MIN_WAIT_S, 2 * min(xi_link, cap) + 4 * cfg.train.poll_every_s)


@dataclass(slots=True)
class Closing:
    """The run's closing: what is left to open, what opened and merged. Its owner
    (`ddiloco.syncer.lifecycle.RoundLifecycle`) opens and closes the rounds; this only decides."""

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
    def begin(
        cls,
        reason: str,
        now: float,
        *,
        next_round: int,
        num_fragments: int,
        busy: Collection[int],
        merged: float,
    ) -> Closing:
        """Closing rounds go to the fragments without an open round (`busy`: those with one), from the next
        in round-robin order (`next_round` mod P); `merged`: tokens merged so far."""
        first = next_round % num_fragments
        order = [(first + i) % num_fragments for i in range(num_fragments)]
        todo = [p for p in order if p not in busy]
        log.info(
            "syncer: closing (%s) at %d tokens merged: learners stop stepping; closing rounds for fragments "
            "%s (%s still open)",
            reason,
            merged,
            todo,
            sorted(busy),
        )
        return cls(reason, now, todo, merged_before=merged)

    def take(self, in_flight: int, overlap: int, live: bool) -> list[int]:
        """The fragments whose closing rounds open now: as many as keep at most τ (`overlap`) rounds in
        flight, none without a live learner (nobody would answer)."""
        if not live:
            self.todo.clear()
        room = max(overlap - in_flight, 0)
        taken, self.todo = self.todo[:room], self.todo[room:]
        return taken

    def is_short_and_due(self, rnd: Round, now: float, wait_s: float) -> bool:
        """An open round without its quorum `wait_s` after it opened and after closing began: no answer
        (nobody had steps on its fragment) or fewer than K (the others' counters restarted with a version:
        they have none to send, now that they do not step)."""
        return rnd.quorum_at is None and now - max(rnd.opened_at, self.began) >= wait_s

    def finished(
        self, now: float, *, open_rounds: Collection[int], unpublished: Collection[int], timeout_s: float
    ) -> bool:
        """Every closing round closed and committed (`open_rounds` and `unpublished` merges: what is still in
        flight); or closing ran `timeout_s` (`diloco.round_timeout_s`, logged)."""
        if not self.todo and not open_rounds and not unpublished:
            return True
        if now - self.began > timeout_s:
            log.warning(
                "syncer: closing took over round_timeout_s=%ss; finishing with rounds %s open and fragments "
                "%s without a closing round",
                timeout_s,
                sorted(open_rounds),
                self.todo,
            )
            return True
        return False

    def figures(self, now: float, merged: float) -> ClosingFigures:
        """What the done marker says about closing: rounds, seconds, tokens it merged (`merged`: the run's
        tokens merged now)."""
        return ClosingFigures(
            closing_rounds=len(self.rounds),
            closing_rounds_merged=self.merged,
            closing_seconds=round(now - self.began, 3),
            closing_tokens_merged=merged - self.merged_before,
        )
