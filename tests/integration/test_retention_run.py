"""Update objects of closed rounds are deleted (issue 16 item 6, part 2): in-process, with the syncer's clock
in the test's hands, a round that merges and a round that is abandoned for want of its quorum."""

from __future__ import annotations

from ddiloco import keys
from ddiloco.learner.loop import Learner
from ddiloco.prepare import prepare
from ddiloco.store.url import open_store
from ddiloco.syncer.loop import Syncer
from tests._harness import tiny_config


def _tick(learner: Learner) -> None:
    learner.poller.poll_once()
    learner.tick()


def test_updates_of_merged_and_abandoned_rounds_are_deleted():
    name = "ret-updates"
    store = open_store(f"memory://{name}")
    cfg = tiny_config(
        name,
        "diloco.quorum=2",
        "diloco.grace=null",
        "diloco.round_timeout_s=5",
        "diloco.token_budget=10000000",
    )
    prepare(store, cfg)
    now = [0.0]
    syncer = Syncer(store, poll_s=0, clock=lambda: now[0])
    learners = [Learner.open(store, i) for i in range(2)]
    for learner in learners:
        learner.start()
    closed: list[tuple[str, int, int, int]] = []  # (how, fragment, round, answers it had)
    merge, abandon = syncer.merge, syncer._abandon

    def merged(rnd, t):
        merge(rnd, t)
        closed.append(("merged", rnd.fragment_id, rnd.round, len(rnd.answers)))
        assert not store.list(keys.update_prefix(rnd.fragment_id, rnd.round))
        for key in store.list(keys.fragment_updates_prefix(rnd.fragment_id)):  # late answers swept too
            assert int(key.split("/")[2]) in syncer.open, key

    def abandoned(rnd):
        abandon(rnd)
        closed.append(("abandoned", rnd.fragment_id, rnd.round, len(rnd.answers)))
        assert not store.list(keys.update_prefix(rnd.fragment_id, rnd.round))

    syncer.merge, syncer._abandon = merged, abandoned
    for _ in range(3000):  # both learners answer: rounds merge
        now[0] += 0.01
        assert not syncer.step()
        for learner in learners:
            _tick(learner)
        if syncer.books.rounds_merged >= 6:
            break
    assert syncer.books.rounds_merged >= 6
    for _ in range(3000):  # learner 1 stops: no round reaches K = 2, each is abandoned after 5 s
        now[0] += 0.25
        assert not syncer.step()
        _tick(learners[0])
        if any(how == "abandoned" and answers == 1 for how, *_, answers in closed):
            break
    assert any(how == "abandoned" and answers == 1 for how, *_, answers in closed), closed
    assert syncer.books.rounds_abandoned >= 1
    for learner in learners:
        learner._finish("max_steps")
