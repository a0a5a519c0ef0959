"""A restarted learner's data cursor: resumed from its predecessor's last report when that is ahead of its
checkpoint (`ddiloco.learner.resume`), and the summary's count of tokens read twice."""

from __future__ import annotations

import torch

from ddiloco import keys
from ddiloco.data.loader import ShardLoader
from ddiloco.learner.resume import resume_from_reports
from ddiloco.posttrain.summary import read_twice
from ddiloco.protocol.learner_report import DataRead
from ddiloco.store.url import open_store
from tests._harness import learner_report


def _loader(n: int = 4000, seed: int = 7) -> ShardLoader:
    return ShardLoader(torch.arange(n, dtype=torch.int32), batch_size=4, seq_len=16, seed=seed)


def _read(loader: ShardLoader, batches: int) -> dict:
    for _ in range(batches):
        loader.next_batch()
    return loader.state_dict()


def test_a_restart_resumes_after_the_last_reported_batch_and_reads_what_an_unkilled_learner_would():
    store = open_store("memory://resume-1")
    ckpt = _read(_loader(), 3)
    store.put_json(keys.report_key(0, 0), {"cursor": _read(_loader(), 10)})
    store.put_json(keys.report_key(0, 1), {"cursor": None})  # died before its first step
    fresh = _loader()
    fresh.load_state_dict(ckpt)
    got = resume_from_reports(fresh, store, 0, incarnation=2)
    assert got["from"] == "report" and got["incarnation"] == 0
    straight = _loader()
    _read(straight, 10)
    assert torch.equal(fresh.next_batch()[0], straight.next_batch()[0])


def test_a_checkpoint_newer_than_the_report_or_a_foreign_cursor_is_kept():
    store = open_store("memory://resume-2")
    store.put_json(keys.report_key(3, 0), {"cursor": _read(_loader(), 2)})
    ahead = _loader()
    _read(ahead, 5)
    assert resume_from_reports(ahead, store, 3, incarnation=1)["from"] == "checkpoint"
    assert ahead.state_dict() == _read(_loader(), 5)
    store.put_json(keys.report_key(3, 0), {"cursor": _read(_loader(n=5000), 9)})  # another shard
    other = _loader()
    assert resume_from_reports(other, store, 3, incarnation=1)["from"] == "checkpoint"
    assert other.state_dict() == _loader().state_dict()
    assert resume_from_reports(_loader(), store, 4, incarnation=0)["from"] == "checkpoint"  # no reports


def test_tokens_read_twice_counts_how_far_behind_each_restart_started():
    span = {"shard": 0, "start": 0, "end": 1000, "own": True}
    incs = [
        learner_report(data=DataRead(**span, epochs=0.5, started=0.0)),
        learner_report(
            data=DataRead(**span, epochs=0.9, started=0.5)
        ),  # resumed at the report: nothing twice
        learner_report(data=DataRead(**span, epochs=1.2, started=0.8)),  # started 0.1 epochs back: 100 tokens
        learner_report(data=None),
        learner_report(data=DataRead(**span, epochs=1.3)),  # a report from before the field
    ]
    assert read_twice(incs) == 100
    assert read_twice([]) == 0
