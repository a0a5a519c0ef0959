"""A learner and a syncer started while the store is out wait for it and then train (through `ddiloco ...`),
and a learner whose start (checkpoint, data cursor, globals) falls into an outage waits too.

Found by the soak benchmark: a learner restarted inside a store outage exited with 2 (`error: store unavailable
... get config.json`) and was restarted 10 s later by the launcher (a pod: by its keeper, from its restart
budget). The role's start-up reads that went through the run's outage wrapper (the learner's link section,
the syncer's config) were not retried; the others already were (`until_store_answers`). The combined chaos test
then found the same for the reads of `Learner.start` (a learner stalled through its start-up met the outage
at `learners/002/ckpt/latest.json`).
"""

from __future__ import annotations

import json
import subprocess
import time

import pytest

import ddiloco.learner.loop as loop
from ddiloco.learner.loop import Learner
from ddiloco.run.prepare import prepare
from ddiloco.store.base import StoreUnavailable
from ddiloco.store.url import open_store
from tests._cli import TINY_RUN_SETS, cli_env, ddiloco, entry_point
from tests._harness import tiny_config

pytestmark = pytest.mark.slow

OUTAGE_S = 20  # from the run's preparation: both roles start inside it (start-up takes a few seconds)


def _start(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*entry_point(), *args], env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def test_roles_started_during_a_store_outage_wait_for_the_store_and_finish_the_run(tmp_path):
    url = (tmp_path / "o").as_uri()
    outage = f"chaos.events=[{{kind: store_outage, at_s: 0, duration_s: {OUTAGE_S}}}]"
    sets = (
        *TINY_RUN_SETS,
        "--set",
        "diloco.learners=1",
        "--set",
        "diloco.token_budget=2000",
        "--set",
        outage,
    )
    prepared = ddiloco("prepare", "--store", url, *sets)
    assert prepared.returncode == 0, prepared.stderr[-3000:]
    t0 = time.monotonic()
    syncer = _start("syncer", "--store", url)
    learner = _start("learner", "--store", url, "--learner-id", "0")
    try:
        _, learner_err = learner.communicate(timeout=240)
        _, syncer_err = syncer.communicate(timeout=120)
    finally:
        learner.kill()
        syncer.kill()
    assert learner.returncode == 0, learner_err[-3000:]  # before: 2, "error: store unavailable"
    assert syncer.returncode == 0, syncer_err[-3000:]
    for role, err in (("learner", learner_err), ("syncer", syncer_err)):
        assert f"{role}: store unavailable at start-up" in err, err[-3000:]  # it did start inside the outage
    assert time.monotonic() - t0 > OUTAGE_S * 0.5
    summary = json.loads(ddiloco("summary", "--store", url).stdout)
    assert summary["status"] == "done" and summary["ledger_balanced"], summary


def test_a_learner_whose_start_meets_an_outage_waits_for_the_store(monkeypatch, caplog):
    store = open_store("memory://start-outage")
    prepare(store, tiny_config("start-outage"))
    learner = Learner.open(store, 0)
    real, calls = loop.restore_learner, []

    def out_once(*args, **kwargs):  # the checkpoint pointer's read during an outage, then the store is back
        calls.append(1)
        if len(calls) == 1:
            raise StoreUnavailable("injected outage: get learners/000/ckpt/latest.json")
        return real(*args, **kwargs)

    monkeypatch.setattr(loop, "restore_learner", out_once)
    try:
        learner.start()  # before: StoreUnavailable escaped, and `ddiloco learner` exited 2
        assert learner.tick() is True
    finally:
        learner.close("max_steps")
    assert len(calls) == 2 and "learner: store unavailable at start-up" in caplog.text
