"""The run summary reads the books the learners and the syncer keep (issue 53): an answer still in flight is
settled by the rule the learner's ledger uses, and summary.json is a typed document read and written the same."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from ddiloco import keys
from ddiloco.learner.ledger import FragmentLedger
from ddiloco.posttrain.summary import build_summary
from ddiloco.protocol.learner_report import FragmentBooks, PendingAnswer
from ddiloco.protocol.messages import Contribution, Done, Ledger, RoundRecord, SyncerState
from ddiloco.protocol.summary import POSTTRAIN_FIELDS, Summary
from ddiloco.run.prepare import prepare
from ddiloco.store.memory import reset_memory_stores
from ddiloco.store.url import open_store
from tests._harness import learner_report, tiny_config

IN_FLIGHT = FragmentBooks(
    anchor=3, c_steps=5, c_tokens=500, c_seconds=5.0, merged_tokens=1000, merged_seconds=10.0,
    discarded_tokens=200, pending=PendingAnswer(round=7, tokens=300, seconds=3.0, steps=3),
)  # fmt: skip


def test_an_answer_in_flight_settles_merged_when_credited_and_the_rest_by_whether_training_goes_on():
    over = IN_FLIGHT.settled(True, final=True)
    assert (over.merged_tokens, over.merged_seconds, over.discarded_tokens) == (1300, 13.0, 400)
    assert (over.c_steps, over.c_tokens, over.c_seconds, over.pending) == (0, 0, 0.0, None)
    going_on = IN_FLIGHT.settled(True, final=False)
    assert (going_on.merged_tokens, going_on.discarded_tokens, going_on.c_tokens, going_on.c_steps) == (
        1300, 200, 200, 2,
    )  # fmt: skip
    not_merged = IN_FLIGHT.settled(False, final=True)
    assert (not_merged.merged_tokens, not_merged.discarded_tokens, not_merged.c_tokens) == (1000, 700, 0)
    assert IN_FLIGHT.settled(False, final=False) == FragmentBooks(**{**IN_FLIGHT.to_json(), "pending": None})
    assert IN_FLIGHT.pending is not None and IN_FLIGHT.c_tokens == 500  # the books read are not changed


def test_the_learners_ledger_settles_by_the_same_rule():
    ledger = FragmentLedger(1)
    for _ in range(5):
        ledger.stepped(100, 1.0)
    ledger.answer_sent(0, 7)
    ledger.stepped(100, 1.0)
    before = replace(ledger[0])
    settled = ledger.applied(0, 4, credited=True)
    assert (settled.merged, settled.discarded) == (500, 100) and ledger.balanced()
    assert ledger[0] == replace(before.settled(True, final=True), anchor=4)


@pytest.fixture
def run():
    """A prepared run (P = 2, M = 3) whose syncer merged round 7 (fragment 0) with learner 1's answer."""
    reset_memory_stores()
    store = open_store("memory://summary/run")
    cfg = tiny_config("run", "diloco.fragments=2", "diloco.learners=3")
    prepare(store, cfg)
    answer = Contribution(300, 3, 3.0, base_version=0, staleness=0, weight=1.0)
    record = RoundRecord(
        round=7, fragment_id=0, version=1, opened_at=1.0, time_to_quorum=1.0, grace_s=0.0, merged_at=2.0,
        quorum=1, contributors={keys.contributor(1, 0): answer}, rejected={}, merged_norm=1.0,
        mean_delta_norm=1.0, ratio=1.0, clipped={},
    )  # fmt: skip
    store.put_json(keys.round_record_key(7), record.to_json())
    state = SyncerState(
        run_id="run", incarnation=0, versions=[1, 0], ledger=[Ledger(1300, 3, 3), Ledger(1000, 2, 2)],
        rejected={}, clipped={}, next_round=8, rounds_merged=1, rounds_abandoned=0, merged_recent=[],
        xi_quorum=0.0, xi_sync=0.0, started_wall=0.0, open_rounds=[], bytes_published=0, late_answers=0,
        learner_events=[],
    )  # fmt: skip
    store.put_json(keys.SYNCER_STATE, state.to_json())
    for lid, pending_round in ((1, 7), (2, 9)):  # learner 1's answer was merged in round 7; 2's not yet
        books = FragmentBooks(
            c_steps=5, c_tokens=500, c_seconds=5.0, merged_tokens=1000 if lid == 1 else 0,
            pending=PendingAnswer(pending_round, 300, 3.0, 3),
        )  # fmt: skip
        other = FragmentBooks(merged_tokens=1000 if lid == 1 else 0, c_tokens=500)
        report = learner_report(
            run_id="run", learner_id=lid, time=10.0, started_at=1.0, tokens_processed=1500 if lid == 1 else 500,
            fragments={"0": books, "1": other}, site="dc1" if lid == 1 else "eu",
        )  # fmt: skip
        store.put_json(keys.report_key(lid, 0), report.to_json())
    yield store
    reset_memory_stores()


def test_while_running_a_credited_answer_is_merged_and_the_rest_outstanding(run):
    s = build_summary(run)
    assert s.status == "running" and s.tokens_merged_per_fragment == [1300, 1000]
    assert s.tokens_merged_by_learners_per_fragment == [1300, 1000] and s.ledger_balanced
    assert s.tokens_outstanding == (200 + 500 + 500 + 500) / 2 and s.tokens_discarded == 0
    assert s.tokens_merged_by_site == {"dc1": 2300 / 2, "eu": 0.0} and s.learners_by_site == {
        "dc1": [1],
        "eu": [2],
    }


def test_once_done_what_was_not_merged_is_discarded(run):
    run.put_json(keys.DONE, Done(12.0, 1150.0, "deadline", 1).to_json())
    s = build_summary(run)
    assert s.status == "done" and s.finished_by == "deadline" and s.closing == {} and s.wall_seconds == 11.0
    assert (
        s.tokens_outstanding == 0 and s.tokens_discarded == (200 + 500 + 500 + 500) / 2 and s.ledger_balanced
    )


def test_the_summary_is_read_as_written_and_post_training_adds_its_fields_at_the_end(run):
    s = build_summary(run)
    doc = json.loads(json.dumps(s.to_json()))
    assert Summary.from_json(doc) == s and not set(POSTTRAIN_FIELDS) & set(doc)
    done = build_summary(run, {"initial_val_loss": 3.0, "final_val_loss": 2.0, "posttrain_seconds": 1.5})
    names = list(done.to_json())
    assert names[-len(POSTTRAIN_FIELDS) :] == list(POSTTRAIN_FIELDS) and names[-8] == "task_accuracy"
    assert Summary.from_json(done.to_json()) == done
    with pytest.raises(ValueError, match="summary: field 'incarnations' is not dict"):
        Summary.from_json(doc | {"incarnations": {"1": "one"}})
    with pytest.raises(ValueError, match="summary: field 'tokens_processed' is missing"):
        Summary.from_json({k: v for k, v in doc.items() if k != "tokens_processed"})
