"""The sweep after a merge counts what it finds under a fragment's closed rounds: answers that came late, and
replays (a merged learner's answer filed again under its round). A merged round whose updates the cleaner
(a thread beside the loop) has not deleted yet holds neither: under load the cleaner runs rounds behind the
loop, and its merged answers were counted as replays (`{'replay': 2}` in a loaded test run)."""

from __future__ import annotations

import threading

from ddiloco import keys
from ddiloco.learner.loop import Learner
from ddiloco.posttrain.summary import build_summary
from ddiloco.run.prepare import prepare
from ddiloco.store.memory import MemoryStore
from ddiloco.syncer.loop import Syncer
from tests._harness import drive, tiny_config


class HeldCleaner(MemoryStore):
    """Deleting a round's updates waits until `release` is set: the cleaner falls rounds behind the loop."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.release = threading.Event()
        self.held = 0

    def delete_prefix(self, prefix: str) -> int:
        if prefix.startswith(keys.UPDATES):
            self.held += 1
            self.release.wait(timeout=60)
        return super().delete_prefix(prefix)


def test_merged_answers_the_cleaner_has_not_reached_are_not_counted_as_replays():
    store = HeldCleaner("late-sweep")
    cfg = tiny_config("late-sweep", "diloco.token_budget=12000")
    prepare(store, cfg)
    syncer = Syncer.open(store, poll_s=0)
    learners = [Learner.open(store, i) for i in range(2)]
    for learner in learners:
        learner.start()

    def release_late() -> None:  # let the cleaner go once several rounds of every fragment merged behind it
        while syncer.books.rounds_merged < 3 * cfg.diloco.fragments and not store.release.is_set():
            threading.Event().wait(0.01)
        store.release.set()

    releaser = threading.Thread(target=release_late, daemon=True)
    releaser.start()
    drive(syncer, learners)
    store.release.set()
    releaser.join()
    s = build_summary(store)
    assert syncer.books.rounds_merged >= 3 * cfg.diloco.fragments and store.held >= 1
    assert s.status == "done" and s.ledger_balanced, s
    assert s.rejected_updates == {}, s.rejected_updates
    assert not any(syncer.intake.rejected.values()), syncer.intake.rejected
