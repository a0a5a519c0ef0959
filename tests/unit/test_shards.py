"""`ddiloco.data.shards`: which shard an id reads, the report's `data`, the summary's record of who read what."""

from __future__ import annotations

import json
import logging

import pytest

from ddiloco.data.shards import assign_shard, data_read
from ddiloco.protocol.learner_report import DataRead, LearnerReport
from tests._harness import learner_report as report
from tests.unit.test_ledger import _report as learner_report

SHARDS = [100, 100, 99]  # tokens per shard, as data/meta.json lists them


def test_ids_below_num_shards_own_consecutive_token_ranges(caplog):
    with caplog.at_level(logging.WARNING):
        got = [assign_shard(i, SHARDS) for i in range(3)]
    assert [(a.shard, a.start, a.end, a.own) for a in got] == [
        (0, 0, 100, True),
        (1, 100, 200, True),
        (2, 200, 299, True),
    ]
    assert caplog.records == []


def test_an_id_beyond_the_shards_shares_one_with_a_warning_that_says_what_to_change(caplog):
    with caplog.at_level(logging.WARNING):
        a = assign_shard(4, SHARDS)
    assert (a.shard, a.start, a.end, a.own) == (1, 100, 200, False)
    (msg,) = [r.getMessage() for r in caplog.records]
    assert "learner 4 has no shard of its own" in msg and "same tokens as learner 1" in msg
    assert "diloco.max_learners" in msg
    with pytest.raises(ValueError, match="≥ 0"):
        assign_shard(-1, SHARDS)
    with pytest.raises(ValueError, match="rerun `ddiloco prepare`"):
        assign_shard(0, [])


def _report(lid: int, inc: int, seq: int, tokens: int, data: DataRead | None) -> LearnerReport:
    return report(learner_id=lid, incarnation=inc, seq=seq, tokens_processed=tokens, data=data)


def test_the_summary_record_takes_each_learners_latest_report_and_lists_shared_and_unread_shards():
    a0, a1, a4 = (assign_shard(i, SHARDS) for i in (0, 1, 4))
    reports = [
        _report(0, 0, 9, 500, a0.read(1.5)),
        _report(0, 1, 2, 300, a0.read(2.5)),  # a later incarnation: its cursor went on
        _report(1, 0, 3, 800, a1.read(4.0)),
        _report(4, 0, 1, 100, a4.read(0.5)),
        _report(7, 0, 1, 0, None),  # a report from before `data` existed
    ]
    got = data_read(reports, num_shards=3)
    assert got["data_shards"] == 3
    assert got["data_read"]["0"] == {
        "shard": 0,
        "start": 0,
        "end": 100,
        "own": True,
        "epochs": 2.5,
        "tokens_processed": 800,
    }
    assert got["data_read"]["4"]["own"] is False and got["data_read"]["4"]["shard"] == 1
    assert got["data_read"]["7"] == {"shard": None, "tokens_processed": 0}
    assert got["shared_shards"] == {"1": [1, 4]}
    assert got["unread_shards"] == [2]


def test_the_reports_data_round_trips_and_older_reports_without_it_still_parse():
    d = assign_shard(2, SHARDS).read(0.25)
    obj = json.loads(json.dumps(learner_report(data=d.to_json())))
    assert LearnerReport.from_json(obj).data == d
    assert json.dumps(LearnerReport.from_json(obj).to_json()) == json.dumps(obj)
    older = {k: v for k, v in learner_report().items() if k != "data"}
    assert LearnerReport.from_json(older).data is None
    with pytest.raises(ValueError, match=r"data.*'own'"):
        LearnerReport.from_json(learner_report(data={**d.to_json(), "own": 1}))
