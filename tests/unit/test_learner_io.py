"""The learner's report writer (ordered, newest wins) and its reader of round records (issue 17 item 8)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor, wait

import pytest

from ddiloco import keys
from ddiloco.learner.io import ReportWriter, RoundRecords
from ddiloco.protocol.messages import Contribution, Merged, OpenRound, RoundRecord
from ddiloco.store.base import StoreUnavailable
from ddiloco.store.url import open_store
from tests._harness import status as _status

KEY = keys.report_key(0, 0)


def test_an_older_report_never_overwrites_a_newer_one():
    store = open_store("memory://lio-order")
    writer = ReportWriter(store, KEY)
    assert writer.write({"seq": 2, "pending": "answer"})
    assert not writer.write({"seq": 1, "pending": None})  # a heartbeat built earlier, landing later
    assert store.get_json(KEY) == {"seq": 2, "pending": "answer"}
    assert writer.write({"seq": 3, "pending": None})
    assert store.get_json(KEY)["seq"] == 3


def test_report_writes_from_many_threads_leave_the_newest():
    store = open_store("memory://lio-threads")
    writer = ReportWriter(store, KEY)
    go = threading.Event()

    def write(seq: int) -> None:
        go.wait()
        writer.write({"seq": seq})

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(write, seq) for seq in range(64, 0, -1)]
        go.set()
        wait(futures)
    assert store.get_json(KEY)["seq"] == 64


def test_a_failed_write_does_not_block_an_older_report(monkeypatch):
    store = open_store("memory://lio-fail")
    writer = ReportWriter(store, KEY)

    def down(key: str, obj: object) -> None:
        raise StoreUnavailable("down")

    monkeypatch.setattr(store, "put_json", down)
    with pytest.raises(StoreUnavailable):
        writer.write({"seq": 5})
    monkeypatch.undo()
    assert writer.write({"seq": 4})  # nothing newer is in the store: this one is the newest there
    assert store.get_json(KEY)["seq"] == 4


def _record(round_: int, contributors: list[str]) -> dict:
    merged = {c: Contribution(128, 1, 1.0, 2, 0, 1.0) for c in contributors}
    return RoundRecord(round_, round_ % 2, 3, 0.0, 0.0, 0.0, 0.0, 1, merged, {}, 0.0, 0.0, 0.0, {}).to_json()


def test_round_records_settle_closed_rounds_the_status_no_longer_lists():
    store = open_store("memory://lio-rounds")
    store.put_json(keys.round_record_key(5), _record(5, ["1-0", "0-0"]))
    store.put_json(keys.round_record_key(9), _record(9, ["0-0"]))
    status = _status(next_round=40, open_rounds=[OpenRound(39, 1, 0.0)])
    rounds = RoundRecords(store)
    pending = {5, 7, 9, 39, 41}  # merged with us, abandoned, merged without us, open, not opened yet
    with ThreadPoolExecutor(1) as pool:
        assert rounds.follow(pool, status, pending) == []  # reads started on the pool
        wait(list(rounds._reads.values()))
        assert sorted(rounds._reads) == [5, 7, 9]
        assert rounds.follow(pool, status, pending) == [7]  # no record: closed without a merge
    assert sorted(rounds.known) == [5, 9]
    assert rounds.decided(status, 5) and rounds.decided(status, 9) and not rounds.decided(status, 39)
    assert "1-0" in rounds.merge_of(status, 5, 1, version=3).contributors
    assert rounds.merge_of(status, 5, 1, version=2) is None  # not in a version this old
    assert "1-0" not in rounds.merge_of(status, 9, 1, version=3).contributors
    with ThreadPoolExecutor(1) as pool:
        rounds.follow(pool, status, {9})
    assert sorted(rounds.known) == [9], "rounds no longer pending are forgotten"


def test_the_status_list_answers_before_any_record_is_read():
    store = open_store("memory://lio-listed")
    status = _status(next_round=4, merged=[Merged(2, 0, 1, {"1-0": 128})])
    rounds = RoundRecords(store)
    with ThreadPoolExecutor(1) as pool:
        assert rounds.follow(pool, status, {2}) == []
    assert not rounds._reads and rounds.decided(status, 2)
    assert rounds.merge_of(status, 2, 0, version=1).contributors == {"1-0": 128}
