"""Learners act only on what the syncer signed (issue 49): a status or a done marker a learner pod wrote,
unsigned or with a learner's key, is ignored and counted; the syncer's own is taken. At 6e3bd56 the status
was plain JSON and any writer's `done: true` stopped every learner that read it."""

from __future__ import annotations

import threading

from ddiloco import keys
from ddiloco.learner.io import StatusPoller
from ddiloco.protocol import signing
from ddiloco.run.root import RunRoot
from ddiloco.store.memory import MemoryStore
from tests._harness import status

MASTER = bytes(range(32))
SYNCER = signing.for_run(MASTER, "run-s")
LEARNER = signing.for_run(signing.key_from_env(signing.learner_env(MASTER)), "run-s")


def test_a_status_the_syncer_did_not_sign_is_ignored_and_counted():
    store = MemoryStore("memory://signed-status")
    poller = StatusPoller(store, 1.0, threading.Event(), LEARNER)
    store.put_json(
        keys.STATUS, signing.sign_doc(status(run_id="run-s", rounds_merged=3).to_json(), SYNCER, "syncer")
    )
    poller.poll_once()
    assert poller.latest is not None and poller.latest.rounds_merged == 3 and not poller.latest.done
    forged = status(run_id="run-s", done=True).to_json()
    for doc in (forged, signing.sign_doc(forged, LEARNER, signing.LEARNER)):
        store.put_json(keys.STATUS, doc)
        poller.poll_once()
        assert not poller.latest.done and poller.latest.rounds_merged == 3  # the last signed one is kept
    assert poller.refused == 2
    store.put_json(
        keys.STATUS, signing.sign_doc(status(run_id="run-s", done=True).to_json(), SYNCER, "syncer")
    )
    poller.poll_once()
    assert poller.latest.done


def test_a_done_marker_counts_only_when_the_syncer_signed_it():
    store = MemoryStore("memory://signed-done")
    learner_root = RunRoot(store, "run-s", LEARNER)
    done = {"time": 1.0, "tokens_merged": 10, "reason": "budget"}
    for doc in (
        done,
        signing.sign_doc(done, LEARNER, signing.LEARNER),
        signing.sign_doc(done, signing.for_run(MASTER, "run-t"), "syncer"),
    ):
        store.put_json(keys.DONE, doc)
        assert not learner_root.is_done() and learner_root.done() is None
    RunRoot(store, "run-s", SYNCER).write_signed_document(keys.DONE, done)
    assert learner_root.is_done() and learner_root.done().reason == "budget"
