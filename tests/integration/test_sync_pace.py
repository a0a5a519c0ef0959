"""The syncer at the paper's pace (P = H: a round opens at every learner step, `diloco.sync_from: open`): the
syncer runs its own loop on a thread while two learners take paced steps (a 40 ms sleep stands in for the
accelerator's step, so a learner step is a fixed, known time and the syncer has the rest of the CPU). Each
fragment must be synced about every H learner steps, and the summary must report the overlap and sync
period it measured (`ddiloco.syncer.pace`)."""

import threading
import time

from ddiloco import keys
from ddiloco.learner.loop import Learner
from ddiloco.posttrain.summary import build_summary
from ddiloco.run.prepare import prepare
from ddiloco.store.url import open_store
from ddiloco.syncer.loop import Syncer, run_until_done
from tests._harness import tiny_config

H = 4
STEP_S = 0.04


def test_at_p_equal_h_each_fragment_is_synced_about_every_h_steps_and_the_summary_says_so():
    store = open_store("memory://pace-p-eq-h")
    cfg = tiny_config(
        "pace-p-eq-h",
        f"diloco.fragments={H}",
        f"diloco.sync_every={H}",
        "diloco.overlap=2",
        "diloco.sync_from=open",
        "diloco.token_budget=20000",
        "retention=null",
    )
    prepare(store, cfg)
    syncer = Syncer.open(store, poll_s=0.002)
    loop = threading.Thread(target=run_until_done, args=(syncer, 120.0), daemon=True)
    learners = [Learner.open(store, i) for i in range(2)]
    for learner in learners:
        learner.start()
    loop.start()
    deadline = time.monotonic() + 120.0
    while loop.is_alive() and time.monotonic() < deadline:
        for learner in learners:
            learner.poller.poll_once()
            learner.tick()
        time.sleep(STEP_S)  # the fake accelerator step: the learners' wall time per step
    loop.join(10.0)
    for learner in learners:
        learner.poller.poll_once()
        learner.tick()
        learner.close("done")
    s = build_summary(store)
    pace = s.sync_pace
    assert s.status == "done" and s.ledger_balanced
    closing = s.closing["closing_rounds_merged"]  # the run's last rounds: the learners do not step
    assert pace["rounds_measured"] == s.rounds - closing > 4 * H
    assert pace["sync_every"] == H and pace["overlap_bound_steps"] == 2
    assert pace["mean_sync_period_steps"] <= 1.25 * H, pace
    assert 0 < pace["mean_overlap_steps"] <= pace["max_overlap_steps"]
    assert s.syncer_lag == pace["syncer_lag"] <= 0.25
    assert pace["syncer_threads_needed"] is None  # kept up: no warning, no threads asked for
    assert store.get_json(keys.SYNCER_PACE)["rounds"] == pace["rounds_measured"]
