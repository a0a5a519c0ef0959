"""A run with a deadline (`diloco.deadline_s`) ends on time, short of its budget, with its books closed."""

import time

from ddiloco import keys
from ddiloco.learner.loop import Learner
from ddiloco.posttrain.summary import build_summary
from ddiloco.run.prepare import prepare
from ddiloco.store.url import open_store
from ddiloco.syncer.loop import Syncer
from tests._harness import drive, tiny_config


def _run(name: str, *overrides: str) -> tuple[dict, float]:
    store = open_store(f"memory://{name}")
    prepare(store, tiny_config(name, *overrides))
    prepared_at = store.get_json(keys.DATA_META)["prepared_at"]
    syncer = Syncer.open(store, poll_s=0)
    learners = [Learner.open(store, i) for i in range(2)]
    for learner in learners:
        learner.start()
    drive(syncer, learners)
    return build_summary(store), time.time() - prepared_at


def test_the_deadline_ends_the_run_short_of_its_budget_with_the_ledger_balanced():
    s, took = _run("deadline", "diloco.token_budget=1000000000", "diloco.deadline_s=3")
    assert s.status == "done" and s.finished_by == "deadline"
    assert 3.0 <= took < 30, took
    assert 0 < s.tokens_merged < s.token_budget
    assert s.ledger_balanced and s.tokens_outstanding == 0
    assert s.global_versions_contiguous


def test_the_budget_still_ends_a_run_before_its_deadline():
    s, _ = _run("budget-first", "diloco.deadline_s=3600")
    assert s.status == "done" and s.finished_by == "budget"
    assert s.tokens_merged >= s.token_budget
