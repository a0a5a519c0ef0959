"""What the cluster does to a running pod - preemption, eviction, OOM kill, an admission error, a drain - as
Argo v4.0.5 classifies it (tests/twin/failures.py), on stock KFP 2.17 and with manifests/argo-retry."""

# No `from __future__ import annotations`: kfp reads the components' annotations at definition time.
from pathlib import Path

import pytest
from kfp import dsl

from tests.twin import KFP_2_17, Twin, load_workflow_defaults, stragglers
from tests.twin.failures import KINDS, overlay_transient_pattern

pytestmark = pytest.mark.twin
OVERLAY = Path(__file__).resolve().parents[2] / "manifests" / "argo-retry"
ORDER = ("preempt", "evict", "oom", "admission", "drain")


@dsl.component(base_image="python:3.11", install_kfp_package=False)
def hold():
    """The first attempt runs until the test injects a failure; every later one succeeds at once."""
    import os
    import time

    if os.environ.get("KFP_RETRY_INDEX", "0") == "0":
        time.sleep(60)


@dsl.pipeline(name="kinds")
def kinds():
    for _ in ORDER:
        hold().set_caching_options(False).set_retry(num_retries=3, backoff_duration="1s", backoff_factor=1.0)


def _run_with_each_kind(path: Path, work: Path, **kw):
    twin = Twin(path, work, time_scale=10, timeout_s=60, pending_timeout_s=0.5, **kw)
    names = ["hold"] + [f"hold-{i}" for i in range(2, len(ORDER) + 1)]
    with twin.start() as ex:
        ex.wait_until(
            lambda r: all(r.task(n).attempts and r.task(n).attempts[0].phase == "Running" for n in names)
        )
        for name, kind in zip(names, ORDER, strict=True):
            ex.inject(ex.record.task(name).attempts[0].pod_name, kind)
        run = ex.wait()
        pods = {p["metadata"]["name"]: p for p in ex.list_pods(twin.cluster.namespace)}
    assert stragglers(run.run_id) == []
    return run, {kind: run.task(n) for n, kind in zip(names, ORDER, strict=True)}, pods


def test_preempt_evict_oom_admission_drain_end_failed_and_stock_kfp_217_does_not_retry(
    compile_pipeline, tmp_path
):
    """operator.go inferFailedReason: Failed with the pod's message, or the main container's terminated state;
    stock OnError retries none of them, so each task and the run fail."""
    run, tasks, pods = _run_with_each_kind(compile_pipeline(kinds), tmp_path, workflow_defaults=KFP_2_17)
    assert run.phase == "Failed"
    want = {
        "preempt": "Pod was terminated in response to imminent node shutdown.",
        "evict": KINDS["evict"].pod_message,
        "oom": "main: OOMKilled (exit code 137)",
        "admission": KINDS["admission"].pod_message,
    }
    for kind, task in tasks.items():
        last = task.attempts[-1]
        assert (task.phase, last.phase) == ("Failed", "Failed"), (kind, run.explain())
        assert "not retried: retryPolicy OnError" in task.reason, (kind, task.reason)
        if kind == "drain":  # SIGTERM'd main container; the pod object is gone after its terminal phase
            assert last.message in ("main: Error (exit code 143)", "main: Error (exit code 137)"), (
                last.message
            )
            assert last.pod_name not in pods
            continue
        assert last.message == want[kind], (kind, last.message)
        status = pods[last.pod_name]["status"]
        assert (status["phase"], status.get("reason", "")) == ("Failed", KINDS[kind].pod_reason), status
    first, rejected = tasks["admission"].attempts  # kubernetes#130145: force-deleted, then rejected
    assert (first.phase, first.message) == ("Error", "pod deleted")
    assert rejected.started_real is None and rejected.status_reason == "UnexpectedAdmissionError"
    assert len(tasks["oom"].attempts) == 1 and tasks["oom"].attempts[0].exit_code == 137


def test_preempt_evict_oom_admission_drain_are_retried_with_the_argo_retry_overlay(
    compile_pipeline, tmp_path
):
    """manifests/argo-retry: OnTransientError with a pattern that matches each kind's message."""
    run, tasks, _ = _run_with_each_kind(
        compile_pipeline(kinds),
        tmp_path,
        workflow_defaults=load_workflow_defaults(OVERLAY / "workflow-defaults.yaml"),
        transient_error_pattern=overlay_transient_pattern(OVERLAY / "controller-env.yaml"),
    )
    assert run.phase == "Succeeded", run.explain()
    for kind, task in tasks.items():
        assert task.phase == "Succeeded" and task.attempts[0].phase in ("Failed", "Error"), (
            kind,
            run.explain(),
        )
    assert [a.phase for a in tasks["admission"].attempts] == ["Error", "Failed", "Succeeded"]
