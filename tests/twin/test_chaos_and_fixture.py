"""The twin with ddiloco's own code: chaos through the Kubernetes API stand-in; the broken db5ec2f YAML."""

# No `from __future__ import annotations`: kfp reads the components' annotations at definition time.
from pathlib import Path

import pytest
from kfp import dsl, kubernetes

from tests.twin import KFP_2_17, Cluster, Twin, stragglers

pytestmark = pytest.mark.twin
FIXTURE = Path(__file__).parent / "fixtures" / "pretrain-db5ec2f.yaml"
FIXTURE_IMAGE = Path(__file__).parent / "fixtures" / "db5ec2f_image"
"""On the pods' PYTHONPATH for the fixture: the top-level `components` package that image installed."""
ALWAYS = {"spec": {"templateDefaults": {"retryStrategy": {"limit": "0", "retryPolicy": "Always"}}}}


@dsl.component(base_image="python:3.11", install_kfp_package=False)
def victim():
    """Sleeps on its first attempt (until deleted), succeeds on a retry."""
    import os
    import time

    if os.environ.get("KFP_RETRY_INDEX", "0") == "0":
        time.sleep(60)


@dsl.component(base_image="python:3.11", install_kfp_package=False)
def chaos_kill(role: str) -> str:
    """The chaos step's job with ddiloco's own Kubernetes backend: find this run's `role` pod, delete it."""
    import os
    import time

    from ddiloco.chaos.k8s import KubernetesPods

    pods = KubernetesPods.connect(
        os.environ["NS"], os.environ["WF"]
    )  # in-cluster config fails, kubeconfig is used
    for _ in range(200):
        live = [name for name, r in pods.pods().items() if r == role]
        if live:
            print("KILL", pods.kill(role, live[0], None))
            return live[0]
        time.sleep(0.05)
    raise RuntimeError(f"no live {role} pod")


@dsl.pipeline(name="chaos")
def _chaos():
    v = victim()
    v.set_retry(num_retries=2, backoff_duration="1s", backoff_factor=1.0, backoff_max_duration="600s")
    kubernetes.add_pod_label(v, "ddiloco.io/role", "learner")
    c = chaos_kill(role="learner")
    kubernetes.use_field_path_as_env(c, "WF", "metadata.labels['workflows.argoproj.io/workflow']")
    kubernetes.use_field_path_as_env(c, "NS", "metadata.namespace")


def test_the_chaos_backend_deletes_a_pod_through_the_api_stand_in_and_argo_retries_it(
    compile_pipeline, tmp_path
):
    twin = Twin(
        compile_pipeline(_chaos),
        tmp_path / "twin",
        cluster=Cluster(namespace="team-a"),
        workflow_defaults=ALWAYS,
        time_scale=10,
        timeout_s=60,
    )
    run = twin.run()
    kill, v = run.task("chaos-kill"), run.task("victim")
    assert kill.phase == "Succeeded", run.explain()
    assert kill.outputs["Output"] == v.attempts[0].pod_name
    lists = [r for r in run.api_requests if r["method"] == "GET"]
    assert lists and lists[0]["query"]["labelSelector"] == (
        f"ddiloco.io/role in (learner,syncer),workflows.argoproj.io/workflow={run.workflow}"
    )
    deletes = [r for r in run.api_requests if r["method"] == "DELETE"]
    assert [d["path"] for d in deletes] == [f"/api/v1/namespaces/team-a/pods/{v.attempts[0].pod_name}"]
    assert deletes[0]["query"]["gracePeriodSeconds"] == "0"
    assert [(a.phase, a.message) for a in v.attempts] == [("Error", "pod deleted"), ("Succeeded", "")]
    assert v.attempts[1].pod_name != v.attempts[0].pod_name and run.phase == "Succeeded"
    assert stragglers(run.run_id) == []


def test_db5ec2f_passes_the_literal_job_uuid_into_the_store_url_and_prepare_fails(tmp_path):
    """The defect this YAML has: `store` embeds {{$.pipeline_job_uuid}}, which only a whole-value constant is
    replaced with; prepare rejects the literal before it makes any S3 request, and nothing else runs."""
    cluster = Cluster(secrets={"mlpipeline-minio-artifact": {"accesskey": "a", "secretkey": "b"}})
    run = Twin(
        FIXTURE,
        tmp_path / "twin",
        cluster=cluster,
        workflow_defaults=KFP_2_17,
        time_scale=5,
        timeout_s=120,
        env={"PYTHONPATH": str(FIXTURE_IMAGE)},
    ).run()
    prep = run.task("prepare")
    values = prep.executor_input["inputs"]["parameterValues"]
    assert values["run_id"] == run.run_id  # whole value: replaced
    assert values["store"].endswith(
        "/{{$.pipeline_job_uuid}}"
    )  # embedded: left for the launcher, which has no such placeholder
    [attempt] = prep.attempts  # KFP 2.17's OnError does not retry a failed main container
    assert attempt.phase == "Failed" and "retryPolicy OnError" in prep.reason
    log = attempt.log.read_text()
    assert "s3://mlpipeline/ddiloco/{{$.pipeline_job_uuid}}" in log and "bad store URL" in log, attempt.tail()
    assert run.phase == "Failed" and {t.phase for t in run.tasks.values() if t.name != "prepare"} == {
        "Omitted"
    }
    assert stragglers(run.run_id) == []
