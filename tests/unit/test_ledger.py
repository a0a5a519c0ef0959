"""The learner's token books (`FragmentLedger`) and the report they are written into (`LearnerReport`)."""

from __future__ import annotations

import json

import pytest

from ddiloco import keys
from ddiloco.learner.ledger import FragmentLedger, Settled
from ddiloco.protocol.learner_report import FragmentBooks, LearnerReport, PendingAnswer
from ddiloco.protocol.messages import Contribution, Merged, RoundRecord, credited


def _balanced(ledger: FragmentLedger) -> None:
    for b in ledger:
        assert ledger.tokens_processed == b.merged_tokens + b.discarded_tokens + b.c_tokens, b
    assert ledger.balanced()


def test_steps_count_for_every_fragment():
    ledger = FragmentLedger(3)
    ledger.stepped(100, 0.5)
    ledger.stepped(100, 0.25)
    assert ledger.tokens_processed == 200 and ledger.busy_seconds == 0.75
    assert all((b.c_steps, b.c_tokens, b.c_seconds) == (2, 200, 0.75) for b in ledger)
    _balanced(ledger)


def test_a_credited_answer_is_merged_and_the_steps_after_it_discarded():
    ledger = FragmentLedger(2)
    ledger.stepped(100, 1.0)
    ledger.stepped(100, 1.0)
    assert ledger.can_answer(0)
    pend = ledger.answer_sent(0, round_=7)
    assert pend == PendingAnswer(7, 200, 2.0, 2) and not ledger.can_answer(0)
    ledger.stepped(100, 1.0)  # overlap: taken after the answer, overwritten by the version that merges it
    assert ledger.pending_rounds() == {7: 0}
    assert ledger.applied(0, 3, credited=True) == Settled(merged=200, discarded=100)
    b = ledger[0]
    assert (b.anchor, b.merged_tokens, b.merged_seconds, b.discarded_tokens) == (3, 200, 2.0, 100)
    assert (b.c_steps, b.c_tokens, b.c_seconds, b.pending) == (0, 0, 0.0, None)
    assert ledger[1].c_tokens == 300  # the other fragment is untouched
    _balanced(ledger)


def test_a_version_that_does_not_credit_the_answer_discards_everything_since_the_anchor():
    ledger = FragmentLedger(1)
    ledger.stepped(50, 1.0)
    ledger.answer_sent(0, 2)
    ledger.stepped(50, 1.0)
    assert ledger.applied(0, 1, credited=False) == Settled(merged=0, discarded=100)
    assert (ledger[0].merged_tokens, ledger[0].merged_seconds, ledger[0].discarded_tokens) == (0, 0.0, 100)
    assert ledger[0].anchor == 1 and ledger[0].pending is None
    _balanced(ledger)


def test_credit_without_a_pending_answer_merges_nothing():
    ledger = FragmentLedger(1)
    ledger.stepped(10, 1.0)
    assert ledger.applied(0, 1, credited=True) == Settled(merged=0, discarded=10)
    _balanced(ledger)


def test_a_dropped_answer_keeps_its_tokens_outstanding_for_the_next_one():
    ledger = FragmentLedger(2)
    ledger.stepped(10, 1.0)
    ledger.answer_sent(1, 4)
    assert not ledger.drop_pending(1, 5)  # another round: not this answer
    assert not ledger.drop_pending(0, 4)  # another fragment
    assert ledger.drop_pending(1, 4)
    assert ledger[1].pending is None and ledger[1].c_tokens == 10 and ledger.can_answer(1)
    ledger.stepped(10, 1.0)
    assert ledger.answer_sent(1, 6) == PendingAnswer(6, 20, 2.0, 2)  # the next answer carries them
    _balanced(ledger)


def test_nothing_to_answer_before_the_first_step():
    ledger = FragmentLedger(1)
    assert not ledger.can_answer(0)


@pytest.mark.parametrize("merged", [True, False])
def test_end_of_run_settles_every_fragment_and_keeps_the_anchor(merged):
    ledger = FragmentLedger(2)
    ledger.applied(0, 5, credited=False)
    ledger.applied(1, 6, credited=False)
    for _ in range(3):
        ledger.stepped(10, 0.5)
    ledger.answer_sent(0, 9)
    ledger.stepped(10, 0.5)
    outstanding = [b.c_tokens for b in ledger]
    assert outstanding == [40, 40]
    _balanced(ledger)  # mid-run: processed = merged + discarded + outstanding
    assert ledger.settle_final(0, credited=merged) == Settled(30 if merged else 0, 10 if merged else 40)
    assert ledger.settle_final(1, credited=False) == Settled(0, 40)
    assert [b.anchor for b in ledger] == [5, 6]
    assert all(b.c_tokens == 0 and b.pending is None for b in ledger)
    assert ledger[0].merged_tokens == (30 if merged else 0)
    _balanced(ledger)  # and at the end nothing is outstanding


def test_the_report_snapshot_is_a_copy():
    ledger = FragmentLedger(1)
    ledger.stepped(10, 1.0)
    ledger.answer_sent(0, 1)
    snap = ledger.snapshot()
    ledger.stepped(10, 1.0)
    ledger.applied(0, 1, credited=True)
    assert snap == {"0": FragmentBooks(0, 1, 10, 1.0, 0, 0.0, 0, PendingAnswer(1, 10, 1.0, 1))}
    assert snap["0"].to_json()["pending"] == {"round": 1, "tokens": 10, "seconds": 1.0, "steps": 1}


def test_credited_names_the_incarnation():
    name = keys.contributor(1, 2)
    merge = Merged(round=3, fragment_id=0, version=2, contributors={name: 100})
    assert credited(merge, 1, 2)
    assert not credited(merge, 1, 1) and not credited(None, 1, 2)
    record = RoundRecord(3, 0, 2, 0.0, 0.0, 0.0, 0.0, 1, {name: Contribution(100, 1, 1.0, 1, 0, 1.0)}, {}, 0.0,
                         0.0, 0.0, {})  # fmt: skip
    assert credited(record, 1, 2) and not credited(record, 1, 1)


def _report(**changes) -> dict:
    ledger = FragmentLedger(2)
    ledger.stepped(64, 0.01)
    ledger.answer_sent(1, 3)
    report = LearnerReport(
        run_id="r",
        learner_id=1,
        incarnation=0,
        seq=4,
        time=10.5,
        started_at=1.0,
        joined_at=None,
        inner_step=1,
        host="h",
        pid=7,
        site="local",
        tokens_processed=64,
        busy_seconds=0.01,
        loss=None,
        loss_ema=None,
        step_time_ema=0.01,
        rounds_answered=1,
        step_wall_ema=None,
        productive_seconds=0.0,
        bytes_up=0,
        bytes_down=0,
        upload_failures=0,
        final=False,
        exit_reason=None,
        fragments=ledger.snapshot(),
        rejected_globals={},
        rejected_updates={"bad_codec": 1},
        history=[[10.0, 1, 64, 5.5]],
        lr=None,
        progress=0.0,
    )
    return report.to_json() | changes


def test_learner_report_round_trips_as_the_same_json():
    obj = json.loads(json.dumps(_report()))
    assert list(obj) == [
        "run_id",
        "learner_id",
        "incarnation",
        "seq",
        "time",
        "started_at",
        "joined_at",
        "inner_step",
        "host",
        "pid",
        "site",
        "tokens_processed",
        "busy_seconds",
        "loss",
        "loss_ema",
        "step_time_ema",
        "rounds_answered",
        "step_wall_ema",
        "productive_seconds",
        "bytes_up",
        "bytes_down",
        "upload_failures",
        "final",
        "exit_reason",
        "fragments",
        "rejected_globals",
        "rejected_updates",
        "history",
        "lr",
        "progress",
        "data",
        "peak_rss_bytes",
        "cursor",
        "tokens_per_s",
        "flops_per_token",
        "peak_flops",
        "peak_flops_source",
        "mfu",
        "device_name",
        "data_wait_seconds",
        "peak_memory_bytes",
        "peak_memory_kind",
    ]
    assert list(obj["fragments"]["0"]) == [
        "anchor",
        "c_steps",
        "c_tokens",
        "c_seconds",
        "merged_tokens",
        "merged_seconds",
        "discarded_tokens",
        "pending",
    ]
    assert obj["fragments"]["1"]["pending"] == {"round": 3, "tokens": 64, "seconds": 0.01, "steps": 1}
    assert json.dumps(LearnerReport.from_json(obj).to_json()) == json.dumps(obj)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"seq": "4"}, "'seq'"),
        ({"final": 1}, "'final'"),
        ({"loss": True}, "'loss'"),
        ({"rejected_updates": {"x": 1.5}}, "'rejected_updates'"),
        ({"history": [1.0]}, "'history'"),
    ],
)
def test_learner_report_from_json_names_the_bad_field(changes, field):
    with pytest.raises(ValueError, match=field):
        LearnerReport.from_json(_report(**changes))


def test_learner_report_from_json_names_a_missing_or_bad_fragment_field():
    obj = _report()
    del obj["fragments"]["0"]["c_tokens"]
    with pytest.raises(ValueError, match=r"fragments\.0.*'c_tokens' is missing"):
        LearnerReport.from_json(obj)
    obj = _report()
    obj["fragments"]["1"]["pending"]["round"] = None
    with pytest.raises(ValueError, match=r"fragments\.1\.pending.*'round'"):
        LearnerReport.from_json(obj)
    with pytest.raises(ValueError, match="'progress' is missing"):
        LearnerReport.from_json({k: v for k, v in _report().items() if k != "progress"})
