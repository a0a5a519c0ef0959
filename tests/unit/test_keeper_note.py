"""A keeper's note on a worker waiting to be scheduled (components/keeper_note.py): written to the run's store
while its worker is held (a Kueue queue without quota), emptied once the worker runs, shown by the run's
summary (`keeper_waits`); a store that cannot be written never stops the keeper."""

from __future__ import annotations

import logging

from ddiloco.components.keeper_note import WaitNote
from ddiloco.components.podsettings import QUEUE_LABEL

from ddiloco.posttrain.summary import keeper_waits
from ddiloco.store.url import open_store
from tests.unit.test_keeper import CASES, Pods, keeper

GATE = {"name": "kueue.x-k8s.io/admission"}


class GatedPods(Pods):
    """Each worker is held by Kueue's scheduling gate for the first `held` reads, then ends as scripted."""

    def __init__(self, endings, held):
        super().__init__(endings)
        self.held, self.seen_waiting = held, []

    def get(self, name):
        got = super().get(name)
        if name in self.created and self.held > 0:
            self.held -= 1
            self.seen_waiting.append(keeper_waits(self.store))
            labels = {**got["metadata"]["labels"], QUEUE_LABEL: "team-a"}
            return {"metadata": {**got["metadata"], "labels": labels}, "spec": {"schedulingGates": [GATE]},
                    "status": {"phase": "Pending"}}  # fmt: skip
        return got


def test_a_held_worker_is_noted_in_the_store_until_it_runs(monkeypatch):
    store = open_store("memory://keeper-note-held")
    pods = GatedPods([CASES["succeeded"][0]], held=3)
    pods.store = store
    k = keeper(pods)
    k.note = WaitNote(lambda: store, "learner-0", clock=lambda: 100.0)
    k.run()
    noted = [w for w in pods.seen_waiting if w]
    assert noted, pods.seen_waiting  # from the second read on, the note is in the store
    doc = noted[0]["learner-0"]
    assert doc["worker"] == pods.created[0] and doc["since"] == 100.0
    assert "waiting for Kueue to admit it (queue 'team-a')" in doc["waiting"]
    assert keeper_waits(store) == {}  # the worker ran and ended: the note says it no longer waits
    assert store.get_json("keeper/learner-0.json")["waiting"] == ""


def test_a_store_that_cannot_be_written_is_a_warning_not_a_failure(caplog):
    def broken():
        raise OSError("connection refused")

    note = WaitNote(broken, "syncer")
    with caplog.at_level(logging.WARNING, logger="ddiloco.components.keeper_note"):
        note.waiting("w-0", "held by scheduling gates")
    assert "could not write keeper/syncer.json" in caplog.text and "connection refused" in caplog.text
