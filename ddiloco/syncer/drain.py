"""The end of a run: every fragment gets one last round on what the learners trained since its last merge.

When the budget is reached the learners hold, on each fragment, what they trained since its last round (on
average H/2 steps each); finishing there would throw that compute away. So the syncer *closes*: its status
says `closing`, learners stop stepping but keep answering and applying versions, and every fragment without
an open round gets one closing round (at most τ in flight, no pacing). While closing, a round merges as soon
as every live learner answered, or `wait_s` after its quorum; a round merged while closing moves its
fragment to the learners' weighted mean (`diloco.closing_step: mean`), not by the outer Nesterov step, whose
look-ahead overshoots at the end. Closing ends when every closing round closed and its publish committed, or
`round_timeout_s` after it began; a syncer restarted while closing closes again from its books.

Design notes (the measurements behind each rule): docs/internals.md, "The end of a run".
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
