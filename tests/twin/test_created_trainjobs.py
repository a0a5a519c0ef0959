"""TrainJobs a step creates through the twin's API stand-in (tests/twin/trainjobs.py), through the official
`kubernetes` client as the keeper sends them: refused where the Trainer webhook refuses them, node pods with
the torch runtime's variables, a lost node pod replaced by the Job, a foreground delete that waits for the
pods, Complete when every node succeeded, and everything gone with its owner."""

# No `from __future__ import annotations`: kfp reads the components' annotations at definition time.
import time

import pytest
from kubernetes import client

from tests.twin import KFP_2_17, Cluster, Twin, stragglers
from tests.twin._keeper_harness import owner  # the keeper's stand-in: a task that holds

pytestmark = [pytest.mark.twin, pytest.mark.slow]
ARGS = ("trainer.kubeflow.org", "v1alpha1", "ns", "trainjobs")
SAY = "import os, signal, time; print('PET', *(os.environ[k] for k in sorted(os.environ) if k.startswith('PET_')), flush=True)"


def _job(name, code, owners, env=(), runtime="torch-distributed"):
    trainer = {"image": "img", "command": ["python3", "-c", code], "numNodes": 2, "numProcPerNode": 1,
               "env": [{"name": "ME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}, *env]}  # fmt: skip
    patch = {"replicatedJobs": [{"name": "node", "template": {"spec": {"template": {"metadata": {"labels": {"a": "b"}}}}}}]}  # fmt: skip
    return {
        "apiVersion": "trainer.kubeflow.org/v1alpha1",
        "kind": "TrainJob",
        "metadata": {"name": name, "ownerReferences": owners},
        "spec": {
            "runtimeRef": {"name": runtime},
            "trainer": trainer,
            "runtimePatches": [{"manager": "x.io/t", "trainingRuntimeSpec": {"template": {"spec": patch}}}],
        },
    }


def _nodes(ex, name):
    with ex.lock:
        return {
            w.body["metadata"]["annotations"]["batch.kubernetes.io/job-completion-index"]: w
            for w in ex.workers.pods.values()
            if w.body["metadata"]["labels"].get("jobset.sigs.k8s.io/jobset-name") == name
        }


def _said(ex, w) -> str:
    try:
        return ex.workers.log(w.name).read_text()
    except OSError:  # not started yet
        return ""


def test_created_trainjobs_run_their_nodes_replace_a_lost_one_and_delete_in_the_foreground(
    compile_pipeline, tmp_path
):
    twin = Twin(
        compile_pipeline(owner), tmp_path, cluster=Cluster(namespace="ns"), workflow_defaults=KFP_2_17,
        time_scale=60, timeout_s=60,
    )  # fmt: skip
    with twin.start() as ex:
        run = ex.wait_until(lambda r: r.task("hold").attempts[0].phase == "Running")
        keeper = run.task("hold").attempts[0]
        conf = client.Configuration()
        conf.host = ex.api.url
        api = client.CustomObjectsApi(client.ApiClient(conf))
        ref = {
            "apiVersion": "v1",
            "kind": "Pod",
            "name": keeper.pod_name,
            "uid": keeper.uid,
            "controller": True,
        }
        for bad in (
            _job("reserved", SAY, [ref], env=[{"name": "PET_NNODES", "value": "3"}]),  # torch.go Validate
            _job("other", SAY, [ref], runtime="mpi-distributed"),
            _job("Not-DNS", SAY, [ref]),
        ):
            with pytest.raises(client.ApiException) as refused:
                api.create_namespaced_custom_object(*ARGS, bad)
            assert refused.value.status == 422, bad["metadata"]["name"]
        api.create_namespaced_custom_object(
            *ARGS, _job("tj", SAY + "; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(30)", [ref])
        )
        api.create_namespaced_custom_object(*ARGS, _job("ok", "print('done')", [ref]))
        ex.wait_until(lambda r: len(_nodes(ex, "tj")) == 2 and all("PET" in _said(ex, w) for w in _nodes(ex, "tj").values()))  # fmt: skip
        for k, w in _nodes(ex, "tj").items():
            pet = _said(ex, w).split()
            port = pet[pet.index("PET") + 2]
            assert pet[pet.index("PET") + 1 :] == ["127.0.0.1", port, "2", k, "1"], (
                pet
            )  # ADDR PORT NNODES RANK NPROC
            assert w.spec.labels["a"] == "b" and w.body["metadata"]["name"].startswith(f"tj-node-0-{k}-")
        lost = _nodes(ex, "tj")["1"]
        ex.delete_pod("ns", lost.name, 0)  # the Job replaces node 1: a new pod, a new uid, the same index
        ex.wait_until(lambda r: "1" in _nodes(ex, "tj") and _nodes(ex, "tj")["1"].uid != lost.uid)
        ex.wait_until(lambda r: [c["type"] for c in ex.trainjobs.get("ok").get("status", {}).get("conditions", [])] == ["Complete"])  # fmt: skip
        api.delete_namespaced_custom_object(*ARGS, "tj", body={"propagationPolicy": "Foreground"})
        going = api.get_namespaced_custom_object(*ARGS, "tj")
        assert going["metadata"]["deletionTimestamp"] and _nodes(ex, "tj")  # pods still going
        ex.wait_until(lambda r: ex.trainjobs.get("tj") is None and not _nodes(ex, "tj"), 10)
        with pytest.raises(client.ApiException) as gone:
            api.get_namespaced_custom_object(*ARGS, "tj")
        assert gone.value.status == 404
        api.create_namespaced_custom_object(*ARGS, _job("late", SAY + "; time.sleep(30)", [ref]))
        ex.wait_until(lambda r: len(_nodes(ex, "late")) == 2)
        ex.delete_pod("ns", keeper.pod_name, 0)  # the owner goes: so do its TrainJobs and their pods
        end = time.monotonic() + 10
        while (ex.trainjobs.jobs or ex.workers.pods) and time.monotonic() < end:
            time.sleep(0.05)
        assert ex.trainjobs.jobs == {} and ex.workers.pods == {}
        ex.terminate()
        run = ex.wait()
    assert stragglers(run.run_id) == []
