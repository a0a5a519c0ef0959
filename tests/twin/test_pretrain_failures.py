"""The compiled `pretrain` pipeline through the twin while the cluster preempts, evicts, OOM-kills and
rejects at admission (after a force delete, kubernetes#130145) both learners and the syncer, each of them
once per kind, under manifests/argo-retry (OnTransientError + its TRANSIENT_ERROR_PATTERN).

Stock KFP 2.17 (templateDefaults retryPolicy OnError) retries none of these: Argo marks each pod Failed
(operator.go inferFailedReason), the first one ends its task and the run fails (test_failure_kinds.py shows
each kind on a one-step pipeline) when learners and the syncer run in their task pods (`--no-keeper`, what
this test compiles); the default keepers survive them on stock KFP (test_keeper_failures.py). This is the
overlay path end to end: marked `long` and deselected by default (~3-10 minutes on 2 cores; run it with
`pytest -m long tests/twin/test_pretrain_failures.py`); test_failure_kinds.py keeps the overlay's rule for
every kind in the default run.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ddiloco.store.url import open_store
from tests.twin import load_workflow_defaults, stragglers
from tests.twin.failures import KINDS, overlay_transient_pattern
from tests.twin.test_pretrain_pipeline import NAMESPACE, twin_and_args

pytestmark = [pytest.mark.twin, pytest.mark.s3, pytest.mark.slow, pytest.mark.long]
OVERLAY = Path(__file__).resolve().parents[2] / "manifests" / "argo-retry"
ROUNDS = (  # (learner 0, learner 1, syncer): every role meets every kind once
    ("preempt", "evict", "oom"),
    ("oom", "admission", "preempt"),
    ("evict", "preempt", "admission"),
    ("admission", "oom", "evict"),
)
TOKEN_BUDGET = 150_000  # ends soon after the last round; the rounds merge far less than this
READY = ("joined run", "joined run", "took the lease")
"""What each target's log says once its role is up: a learner incarnation joined, the syncer holds the lease."""


def _targets(run) -> list:
    learners = sorted(
        run.find("learner"), key=lambda t: t.executor_input["inputs"]["parameterValues"]["learner_id"]
    )
    return [*learners, run.task("syncer")]


def _ready(run) -> bool:
    if len(run.find("learner")) != 2 or not run.task("syncer").attempts:
        return False
    if any(t.done for t in _targets(run)):
        raise AssertionError(f"a target ended before all failures were injected:\n{run.explain()}")
    last = [t.attempts[-1] for t in _targets(run)]
    return all(a.phase == "Running" and marker in _log(a) for a, marker in zip(last, READY, strict=True))


def _log(attempt) -> str:
    try:
        return attempt.log.read_text(errors="replace")
    except OSError:
        return ""


@pytest.fixture(scope="module")
def hit_run(s3_server, tmp_path_factory):
    from ddiloco.pipelines.compile import compile_pipeline

    work = tmp_path_factory.mktemp("twin-failures")
    twin, args = twin_and_args(
        compile_pipeline("pretrain", work / "pretrain.yaml", keeper=False), s3_server, work, TOKEN_BUDGET
    )
    twin.workflow_defaults = load_workflow_defaults(OVERLAY / "workflow-defaults.yaml")
    twin.transient_error_pattern = overlay_transient_pattern(OVERLAY / "controller-env.yaml")
    twin.timeout_s = 560  # under pytest-timeout, so a slow run fails with the twin's explanation
    args["chaos"] = ""
    with twin.start(args) as ex:
        for kinds in ROUNDS:
            run = ex.wait_until(_ready, 180)
            with ex.lock:
                for task, kind in zip(_targets(run), kinds, strict=True):
                    ex.inject(task.attempts[-1].pod_name, kind)
        run = ex.wait()
    return run, s3_server


def _hits(task) -> list[str]:
    """The failure kinds the task's attempts ended with, in order (by Argo's message)."""
    out = []
    for a in task.attempts:
        for k in KINDS.values():
            if a.phase == "Failed" and a.message == k.argo_message(a.exit_code):
                out.append(k.name)
    return out


def test_learners_survive_preempt_evict_oom_admission_with_argo_retry(hit_run):
    run, s3 = hit_run
    assert run.phase == "Succeeded", run.explain()
    learners = _targets(run)[:2]
    for lid, task in enumerate(learners):
        assert _hits(task) == [r[lid] for r in ROUNDS], (lid, run.explain())
        assert task.phase == "Succeeded" and task.attempts[-1].phase == "Succeeded", run.explain()
        assert task.executor_input["inputs"]["parameterValues"]["learner_id"] == lid
    store = open_store(f"s3://{s3.bucket}/private/{NAMESPACE}/ddiloco/{run.run_id}", env=s3.env())
    for lid in range(2):  # every pod that ran came back as the same learner, from its checkpoint
        incarnations = {
            k.split("/")[2] for k in store.list(f"learners/{lid:03d}/") if k.endswith("report.json")
        }
        # each pod that ran came back as this learner, a new incarnation (the last one is inc-0004)
        assert f"inc-{len(ROUNDS):04d}" in incarnations, (lid, incarnations)
    assert stragglers(run.run_id) == []


def test_the_syncer_survives_preempt_evict_oom_admission_with_argo_retry(hit_run):
    run, s3 = hit_run
    assert run.phase == "Succeeded", run.explain()
    syncer = run.task("syncer")
    assert _hits(syncer) == [r[2] for r in ROUNDS], run.explain()
    assert syncer.attempts[-1].phase == "Succeeded"
    store = open_store(f"s3://{s3.bucket}/private/{NAMESPACE}/ddiloco/{run.run_id}", env=s3.env())
    assert store.exists("done.json") and store.exists("final/model.safetensors")
    assert run.task("evaluate").phase == "Succeeded" and run.task("report").phase == "Succeeded"
