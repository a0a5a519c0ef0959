"""Pods a step creates through the twin's API stand-in (tests/twin/workers.py): scheduled on the twin's nodes,
run as real processes, reported as the kubelet reports them, ended by the failure kinds, garbage-collected
with their owners."""

# No `from __future__ import annotations`: kfp reads the components' annotations at definition time.
import time

import pytest
from kubernetes import client

from tests.twin import KFP_2_17, Cluster, Twin, stragglers
from tests.twin._keeper_harness import owner  # the keeper's stand-in: a task that holds

pytestmark = pytest.mark.twin


def _pod(name, argv, owners, gpu=False, tolerate=True):
    spec = {"restartPolicy": "Never", "containers": [{"name": "main", "image": "img", "command": argv}]}
    if gpu:
        spec["containers"][0]["resources"] = {"limits": {"nvidia.com/gpu": "1"}}
        if tolerate:
            spec["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists"}]
    spec["containers"][0]["env"] = [
        {"name": "ME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "KEY", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}},
    ]
    return {"metadata": {"name": name, "labels": {"a": "b"}, "ownerReferences": owners}, "spec": spec}


def test_created_pods_run_fail_as_the_cluster_ends_them_and_go_with_their_owner(compile_pipeline, tmp_path):
    twin = Twin(
        compile_pipeline(owner), tmp_path, cluster=Cluster(namespace="ns", secrets={"s": {"k": "v"}}),
        workflow_defaults=KFP_2_17, time_scale=60, timeout_s=60,
    )  # fmt: skip
    with twin.start() as ex:
        run = ex.wait_until(lambda r: r.task("hold").attempts[0].phase == "Running")
        keeper = run.task("hold").attempts[0]
        conf = client.Configuration()
        conf.host = ex.api.url
        api = client.CoreV1Api(client.ApiClient(conf))
        ref = {
            "apiVersion": "v1",
            "kind": "Pod",
            "name": keeper.pod_name,
            "uid": keeper.uid,
            "controller": True,
        }
        say = ["python3", "-c", "import os; print(os.environ['ME'], os.environ['KEY'])"]
        api.create_namespaced_pod("ns", _pod("ok", say, [ref]))
        api.create_namespaced_pod("ns", _pod("gpu", ["sleep", "30"], [ref], gpu=True))
        api.create_namespaced_pod(
            "ns", _pod("no-toleration", ["sleep", "30"], [ref], gpu=True, tolerate=False)
        )
        api.create_namespaced_pod("ns", _pod("oom", ["sleep", "30"], [ref]))
        with pytest.raises(client.ApiException) as taken:
            api.create_namespaced_pod("ns", _pod("ok", say, [ref]))
        assert taken.value.status == 409
        ex.wait_until(
            lambda r: ex.workers.pods["ok"].phase == "Succeeded" and ex.workers.pods["oom"].phase == "Running"
        )
        assert "ok v" in ex.workers.log("ok").read_text()
        gpu = api.read_namespaced_pod("gpu", "ns")
        assert gpu.spec.node_name.startswith("gke-twin-gpu-pool") and gpu.status.phase == "Running"
        assert api.read_namespaced_pod("no-toleration", "ns").status.phase == "Pending"
        ex.inject("oom", "oom")
        ex.wait_until(lambda r: ex.workers.pods["oom"].phase == "Failed")
        oom = api.read_namespaced_pod("oom", "ns").status
        assert (
            oom.container_statuses[0].state.terminated.reason,
            oom.container_statuses[0].state.terminated.exit_code,
        ) == ("OOMKilled", 137)
        ex.inject("gpu", "admission")  # kubernetes#130145: gone, and the node rejects the next GPU pod
        with pytest.raises(client.ApiException):
            api.read_namespaced_pod("gpu", "ns")
        api.create_namespaced_pod("ns", _pod("gpu-2", ["sleep", "30"], [ref], gpu=True))
        ex.wait_until(lambda r: ex.workers.pods["gpu-2"].phase == "Failed")
        assert api.read_namespaced_pod("gpu-2", "ns").status.reason == "UnexpectedAdmissionError"
        api.delete_namespaced_pod(keeper.pod_name, "ns", grace_period_seconds=0)  # the owner goes: so do they
        end = time.monotonic() + 10
        while ex.workers.pods and time.monotonic() < end:
            time.sleep(0.05)
        assert ex.workers.pods == {}
        ex.terminate()
        run = ex.wait()
    assert stragglers(run.run_id) == []
