"""The closing rule's decisions (`ddiloco.syncer.drain`) on a stand-in syncer: which fragments get a closing
round, how many at once, when an empty one closes and when closing ends."""

from __future__ import annotations

from ddiloco.protocol.messages import Status
from ddiloco.syncer.drain import MIN_WAIT_S, Closing, wait_s
from ddiloco.syncer.rounds import Answer, Round
from tests._harness import status, tiny_config


class StandIn:
    """What `Closing` is told of a syncer: its next round, open rounds, config, whether a learner is live;
    `open_next` opens rounds as the round owner does."""

    def __init__(self, P: int = 4, next_round: int = 9, open_fragments=(), live=("0",)) -> None:
        self.P, self.cfg, self.next_round = P, tiny_config("drain", "diloco.overlap=2"), next_round
        self.open = {100 + i: Round(100 + i, p, 0.0, 0.0) for i, p in enumerate(open_fragments)}
        self.unpublished: dict = {}
        self.live = list(live)

    def begin(self, reason: str, now: float) -> Closing:
        busy = {r.fragment_id for r in self.open.values()}
        return Closing.begin(
            reason, now, next_round=self.next_round, num_fragments=self.P, busy=busy, merged=1000.0
        )

    def open_next(self, c: Closing, now: float) -> None:
        for p in c.take(len(self.open), self.cfg.diloco.overlap, live=bool(self.live)):
            self.open[self.next_round] = Round(self.next_round, p, now, 0.0)
            c.rounds.add(self.next_round)
            self.next_round += 1

    def finished(self, c: Closing, now: float) -> bool:
        timeout_s = self.cfg.diloco.round_timeout_s
        return c.finished(now, open_rounds=self.open, unpublished=self.unpublished, timeout_s=timeout_s)


def test_closing_rounds_go_to_the_fragments_without_an_open_round_in_round_robin_order():
    s = StandIn(P=4, next_round=9, open_fragments=[0])  # next in round-robin: 9 mod 4 = 1
    c = s.begin("budget", now=5.0)
    assert c.todo == [1, 2, 3]
    s.open_next(c, now=5.0)  # τ = 2 in flight, one of them the open round of fragment 0
    assert [r.fragment_id for r in s.open.values()] == [0, 1]
    assert c.rounds == {9} and s.next_round == 10
    del s.open[100], s.open[9]
    s.open_next(c, now=6.0)
    assert sorted(r.fragment_id for r in s.open.values()) == [2, 3] and c.todo == []


def test_no_closing_round_without_a_live_learner_and_closing_ends_when_all_closed():
    s = StandIn(live=())
    c = s.begin("deadline", now=0.0)
    s.open_next(c, now=0.0)
    assert s.open == {} and c.todo == []
    assert s.finished(c, now=0.1)


def test_a_closing_round_without_its_quorum_closes_after_its_wait_and_one_with_it_does_not():
    s = StandIn()
    c = s.begin("budget", now=0.0)
    s.open_next(c, now=0.0)
    empty, answered = (s.open[r] for r in sorted(c.rounds))
    answered.answers["learner 0"] = Answer("learner 0", header=None, delta=None)  # type: ignore[arg-type]
    wait = wait_s(s.cfg, xi_link=0.0)
    assert wait >= MIN_WAIT_S
    assert not c.is_short_and_due(empty, now=wait / 2, wait_s=wait)
    assert c.is_short_and_due(empty, now=wait, wait_s=wait)
    assert c.is_short_and_due(answered, now=wait, wait_s=wait)  # below the quorum: abandoned
    answered.quorum_at = 0.5
    assert not c.is_short_and_due(answered, now=10 * wait, wait_s=wait)  # merges by the quorum rule
    assert not s.finished(c, now=1.0)
    assert s.finished(c, now=s.cfg.diloco.round_timeout_s + 1.0)  # bounded: never hangs a finished run


def test_the_status_says_closing_and_an_older_status_reads_as_not_closing():
    st = status(closing=True)
    assert Status.from_json(st.to_json()).closing is True
    older = status().to_json()
    del older["closing"]
    assert Status.from_json(older).closing is False


def test_a_round_opened_before_closing_that_nobody_can_answer_closes_a_wait_after_closing_began():
    """Learners whose counters a version restarted have nothing to send once they stop: without this the
    round waited `round_timeout_s` (120 s) and held the finished run (seen in `test_deadline`)."""
    s = StandIn(open_fragments=[1])
    before = s.open[100]
    before.opened_at = -50.0
    c = s.begin("deadline", now=10.0)
    wait = wait_s(s.cfg, xi_link=0.0)
    assert not c.is_short_and_due(before, now=10.0 + wait / 2, wait_s=wait)
    assert c.is_short_and_due(before, now=10.0 + wait, wait_s=wait)
