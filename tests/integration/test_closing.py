"""The end of a run (`ddiloco.syncer.drain`): no learner's compute is left unanswered when the run finishes.

Deterministic in-process runs (the harness of `test_bad_inputs`: one thread, inline I/O, a syncer clock that
advances one "second" per pass). Before the syncer closed its runs, every fragment ended holding what the
learners trained since its last round (up to H steps each), and that was discarded when the run finished.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from ddiloco import keys
from ddiloco.posttrain.summary import round_records
from ddiloco.run.root import RunRoot
from tests.integration.test_bad_inputs import SECRET, Run, start, tick

ROOT = Path(__file__).resolve().parents[2]


def drive(r: Run, on_pass=None) -> None:
    for _ in range(5000):
        r.now[0] += 1.0
        if r.syncer.step():
            return
        tick(r)
        if on_pass is not None:
            on_pass(r)
    raise AssertionError("the run did not finish")


def unanswered_steps(r: Run) -> dict[tuple[int, int], int]:
    """(learner, fragment) -> steps taken after the learner's last answer on that fragment (0: none)."""
    out = {}
    for learner in r.learners:
        for p, b in enumerate(learner.ledger):
            out[(learner.learner_id, p)] = b.c_steps - (b.pending.steps if b.pending else 0)
    return out


def test_every_step_of_every_learner_is_answered_when_the_run_finishes():
    r = start("closing", "diloco.sync_every=8", "diloco.token_budget=12000")
    seen: dict[int, int] = {}  # learner -> its inner step when it first saw the syncer closing

    def watch(r: Run) -> None:
        for learner in r.learners:
            status = learner.poller.latest
            closing = getattr(status, "closing", False)  # (a status before closing existed has none)
            if closing and learner.learner_id not in seen:
                seen[learner.learner_id] = learner.inner_step

    drive(r, watch)
    assert unanswered_steps(r) == dict.fromkeys(unanswered_steps(r), 0)
    assert set(seen) == {0, 1}, "the learners never saw the run closing"
    # a learner that saw `closing` took no step after it
    assert {learner.learner_id: learner.inner_step for learner in r.learners} == seen
    done = RunRoot(r.store, r.name, r.key).done()
    assert done is not None and done.reason == "budget" and done.closing is not None
    assert done.closing.closing_rounds >= 1 and done.closing.closing_tokens_merged > 0
    assert done.tokens_merged >= 12000
    for learner in r.learners:  # what settles at the end is credited, not discarded
        learner.poller.poll_once()
        assert learner.tick() is False
        learner.close("done")
        assert learner.ledger.balanced()
        assert all(b.c_tokens == 0 for b in learner.ledger)


def test_a_closing_round_nobody_can_answer_closes_empty_and_the_run_finishes():
    """Learners that stopped (their final report) leave no live learner: closing opens no round."""
    r = start("closing-dead", "diloco.sync_every=8", "diloco.token_budget=12000")
    for _ in range(5000):  # train until the syncer closes, then kill the learners without answering
        r.now[0] += 1.0
        if r.syncer.step():
            raise AssertionError("finished without closing")
        if r.syncer.rounds.closing is not None:
            break
        tick(r)
    for learner in r.learners:
        learner.close("error")  # a final report: not live
    start_clock = r.now[0]
    drive_syncer_only(r)
    assert r.now[0] - start_clock < r.syncer.cfg.diloco.round_timeout_s
    assert r.store.exists(keys.DONE)


def drive_syncer_only(r: Run) -> None:
    for _ in range(5000):
        r.now[0] += 1.0
        r.syncer._next_refresh = 0.0  # the roster looks at the reports every pass
        if r.syncer.step():
            return
    raise AssertionError("the syncer did not finish")


@pytest.mark.parametrize("closing_step", ["mean", "outer"])
def test_the_rounds_merged_while_the_run_closes_take_the_closing_step(closing_step: str, capsys, monkeypatch):
    """`diloco.closing_step` (default `mean`): the rounds merged while the run closes, the last move of their
    fragment, say which step they took in their round record; every round before closing took the outer
    step. (`tests/unit/test_fragment.py` checks the `mean` step's arithmetic.)"""
    r = start(
        f"closing-{closing_step}",
        "diloco.sync_every=8",
        "diloco.token_budget=12000",
        f"diloco.closing_step={closing_step}",
    )
    closing_when_merged: dict[int, bool] = {}  # round -> whether the run was closing when it merged
    merge = r.syncer.rounds.merge

    def watched_merge(rnd, now):
        closing_when_merged.setdefault(rnd.round, r.syncer.rounds.closing is not None)
        merge(rnd, now)

    r.syncer.rounds.merge = watched_merge
    drive(r)
    steps = {rec.round: rec.step for rec in round_records(r.store)}
    assert any(closing_when_merged[n] for n in steps), "no round merged while the run closed"
    for n, step in steps.items():
        assert step == (closing_step if closing_when_merged[n] else "outer"), (n, step)
    if closing_step == "mean":  # benchmarks/closing_move.py finds the same rounds from the books alone
        move = closing_move(f"memory://closing-{closing_step}", capsys, monkeypatch)
        assert {m["round"] for m in move["merged_while_closing"]} == {
            n for n in steps if closing_when_merged[n]
        }
        assert {m["step"] for m in move["merged_while_closing"]} == {"mean"}
        assert move["pre_round"] == max(n for n in steps if not closing_when_merged[n])
        before, final = move["val_loss"]["before"], move["val_loss"]["final"]
        assert math.isfinite(before) and math.isfinite(final) and before != final
        assert move["loss_by_alpha"]["0.0"] == pytest.approx(before, rel=1e-6)
        assert move["loss_by_alpha"]["1.0"] == pytest.approx(final, rel=1e-5)


def closing_move(store: str, capsys, monkeypatch) -> dict:
    """`benchmarks/closing_move.py --store STORE --alphas 0,1` in this process (the memory store is here)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import closing_move as module
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    monkeypatch.setenv("DDILOCO_RUN_KEY", SECRET.hex())
    capsys.readouterr()
    assert module.main(["--store", store, "--alphas", "0,1"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])
