"""The syncer's stateful parts (`ddiloco.stateful`): each saves and restores its own fields of the state, a
restarted syncer writes back exactly what it read, and no two parts claim one field."""

from collections import Counter

import pytest

from ddiloco import keys
from ddiloco.protocol.messages import LearnerEvent, Merged
from ddiloco.run.prepare import prepare
from ddiloco.stateful import Stateful, gather, restore
from ddiloco.store.url import open_store
from ddiloco.syncer.loop import Syncer
from ddiloco.syncer.pace import Pace
from tests._harness import tiny_config


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_two_parts_that_claim_one_field_are_refused():
    class Part:
        def __init__(self, state):
            self.state = state

        def state_dict(self):
            return dict(self.state)

        def load_state_dict(self, state):
            self.state = {k: state[k] for k in self.state}

    a, b = Part({"x": 1}), Part({"y": 2})
    assert isinstance(a, Stateful) and gather([a, b]) == {"x": 1, "y": 2}
    restore([a, b], {"x": 3, "y": 4, "z": 5})  # each takes its own fields, ignores the others
    assert (a.state, b.state) == ({"x": 3}, {"y": 4})
    with pytest.raises(ValueError, match="claims fields another part owns"):
        gather([a, Part({"x": 2})])


def test_pace_aggregates_round_trip_but_the_busy_share_is_measured_afresh():
    pace = Pace(since=5.0)
    pace.add(1.5, 4.0, 0.25)
    state = pace.state_dict()
    assert "since" not in state and "warned_at" not in state
    again = Pace(since=9.0)
    again.load_state_dict(state)
    assert again.state_dict() == state | {"busy_seconds": 0.0} and again.since == 9.0, "busy: measured afresh"


def test_a_restarted_syncer_saves_what_its_parts_restored():
    store = open_store("memory://stateful-restart")
    prepare(store, tiny_config("stateful-restart"))
    first = Syncer.open(store, clock=Clock(50.0), wall=Clock(1_000_000.0), poll_s=0)
    parts = first.stateful_parts()
    assert len({id(p) for p in parts}) == 4 and all(isinstance(p, Stateful) for p in parts)
    first.books.merged_recent.append(Merged(3, 1, 2, {"0-0": 128}))
    first.books.clipped["norm_outlier"] += 2
    first.books.xi_link, first.books.rounds_abandoned = 0.25, 4
    first.intake.rejected["truncated"] += 1
    first.intake.late_answers = 3
    first.roster.events.append(LearnerEvent("joined", "0-0", 1_000_001.0))
    first.files.slots.quarantined["malformed"] += 1
    first.save_state()
    saved = store.get_json(keys.SYNCER_STATE)

    second = Syncer.open(store, clock=Clock(70.0), wall=Clock(2_000_000.0), poll_s=0)
    assert second.intake.rejected == Counter(truncated=1) and second.intake.late_answers == 3
    assert second.roster.events == [LearnerEvent("joined", "0-0", 1_000_001.0)]
    assert second.books.merged_recent.maxlen == first.books.merged_recent.maxlen
    second.save_state()
    again = store.get_json(keys.SYNCER_STATE)
    assert list(again) == list(saved), "the document's field order is unchanged"
    assert again == saved | {"incarnation": saved["incarnation"] + 1, "epoch": saved["epoch"] + 1}
