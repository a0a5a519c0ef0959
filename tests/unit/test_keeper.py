"""The keeper's decisions on pod JSON in the shape Kubernetes reports it (ddiloco.components.keeper), and its
loop against an in-memory pod table (ddiloco.components.keeper_loop.Keeper)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
from ddiloco.components.keeper import (
    CRASH,
    INFRA,
    RUNNING,
    SUCCEEDED,
    USAGE,
    Slot,
    WorkerSpec,
    classify,
    pick,
    worker_manifest,
    workflow_stopped,
)
from ddiloco.components.keeper_loop import Keeper, KeeperFailed, worker_env

from ddiloco.chaos.k8s import ROLE_LABEL, WORKFLOW_LABEL


def pod(phase, reason="", message="", terminated=None, conditions=(), deleting=False, n=0, name=None):
    """A pod as GET /api/v1/namespaces/ns/pods/NAME returns it (the fields the keeper reads)."""
    status = {"phase": phase}
    if reason:
        status["reason"] = reason
    if message:
        status["message"] = message
    if conditions:
        status["conditions"] = list(conditions)
    if terminated is not None:
        status["containerStatuses"] = [
            {"name": "main", "ready": False, "restartCount": 0, "state": {"terminated": terminated}}
        ]
    elif phase == "Running":
        status["containerStatuses"] = [
            {"name": "main", "state": {"running": {"startedAt": "2026-01-01T00:00:00Z"}}}
        ]
    meta = {"name": name or f"w-{n}", "labels": {"ddiloco.io/incarnation": str(n)}}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:05Z"
    return {"metadata": meta, "status": status}


def term(code, reason="Error"):
    return {"exitCode": code, "reason": reason, "startedAt": "2026-01-01T00:00:00Z"}


DISRUPTION = {"type": "DisruptionTarget", "status": "True", "reason": "TerminationByKubelet"}
SHUTDOWN = ("Terminated", "Pod was terminated in response to imminent node shutdown.")
EVICTED = ("Evicted", "The node was low on resource: memory. Threshold quantity: 100Mi, available: 60Mi. ")
ADMISSION = ("UnexpectedAdmissionError", "Allocate failed due to requested number of devices unavailable ...")

CASES = {
    "gone": (None, INFRA),
    "running": (pod("Running"), RUNNING),
    "pending": (pod("Pending"), RUNNING),
    "succeeded": (pod("Succeeded", terminated=term(0, "Completed")), SUCCEEDED),
    "preempt": (pod("Failed", *SHUTDOWN, term(137), [DISRUPTION]), INFRA),
    "preempt before 1.22": (pod("Failed", "Shutdown", "Node is shutting, evicting pods", term(143)), INFRA),
    "evict": (pod("Failed", *EVICTED, term(137), [DISRUPTION]), INFRA),
    "evict without condition": (pod("Failed", *EVICTED, term(137)), INFRA),
    "oom": (pod("Failed", terminated=term(137, "OOMKilled")), INFRA),
    "admission": (pod("Failed", *ADMISSION), INFRA),
    "out of gpus": (pod("Failed", "OutOfnvidia.com/gpu", "Node didn't have enough resource"), INFRA),
    "drained, sigterm": (
        pod(
            "Failed",
            terminated=term(143),
            deleting=True,
            conditions=[{**DISRUPTION, "reason": "EvictionByEvictionAPI"}],
        ),
        INFRA,
    ),
    "being drained": (pod("Running", deleting=True), RUNNING),
    "crash": (pod("Failed", terminated=term(1)), CRASH),
    "segfault": (pod("Failed", terminated=term(139)), CRASH),
    "usage error": (pod("Failed", terminated=term(2)), USAGE),
    "never ran": (pod("Failed"), INFRA),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_classify_reads_how_kubernetes_ended_the_pod(case):
    body, want = CASES[case]
    assert classify(body).state == want, classify(body)


def test_pick_adopts_the_newest_live_worker_and_counts_earlier_crashes():
    pods = [
        pod("Failed", terminated=term(1), n=0),
        pod("Failed", *EVICTED, term(137), n=1),
        pod("Running", n=2),
    ]
    got = pick(pods)
    assert got.adopt["metadata"]["name"] == "w-2" and got.next_incarnation == 3
    assert (got.crashes, got.infra) == (1, 1)
    assert pick([]).adopt is None and pick([]).next_incarnation == 0


def test_pick_after_the_worker_ended_starts_the_next_or_is_done():
    assert pick([pod("Failed", terminated=term(137, "OOMKilled"), n=4)]).next_incarnation == 5
    assert pick([pod("Failed", terminated=term(137, "OOMKilled"), n=4)]).adopt is None
    assert pick([pod("Succeeded", terminated=term(0), n=1)]).done is not None
    assert pick([pod("Failed", terminated=term(2), n=0)]).ending is not None
    going = pick([pod("Running", deleting=True, n=0)])
    assert going.adopt is None and going.terminating == ["w-0"] and going.next_incarnation == 1


KEEPER_POD = {
    "metadata": {
        "name": "pretrain-abc-system-container-impl-123",
        "namespace": "team-a",
        "uid": "k-uid",
        "labels": {WORKFLOW_LABEL: "pretrain-abc", "ddiloco.io/keeper": "learner"},
        "ownerReferences": [
            {"apiVersion": "argoproj.io/v1alpha1", "kind": "Workflow", "name": "pretrain-abc", "uid": "wf-uid",
             "controller": True, "blockOwnerDeletion": True}
        ],
    },
    "spec": {"serviceAccountName": "default-editor"},
}  # fmt: skip
SPEC = WorkerSpec(
    image="reg/ddiloco-learner:1",
    command=["python3", "-m", "ddiloco.cli", "learner"],
    env=worker_env(
        {"accesskey": "AK"}, "store-secret", "s3:9000", {"secret": "rk", "key": "key", "env": "RK"}
    ),
    requests={"cpu": "4"},
    limits={"nvidia.com/gpu": "1"},
    node_selector={"pool": "gpu"},
    tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists"}],
)


def test_worker_manifest_names_labels_owners_and_env():
    slot = Slot("learner", "3f2a-run", 3)
    m = worker_manifest(slot, 7, SPEC, KEEPER_POD)
    assert m["metadata"]["name"] == slot.name(7) == f"ddiloco-learner-3-{slot.run_hash}-7"
    assert len(m["metadata"]["name"]) <= 63 and slot.name(7) != Slot("learner", "other-run", 3).name(7)
    labels = m["metadata"]["labels"]
    assert labels[ROLE_LABEL] == "learner" and labels[WORKFLOW_LABEL] == "pretrain-abc"
    assert "workflows.argoproj.io/completed" not in labels  # Argo's pod informer must not pick it up
    owners = {(o["kind"], o["uid"], o["controller"]) for o in m["metadata"]["ownerReferences"]}
    assert owners == {("Pod", "k-uid", True), ("Workflow", "wf-uid", False)}
    assert all("blockOwnerDeletion" not in o for o in m["metadata"]["ownerReferences"])
    spec = m["spec"]
    assert spec["restartPolicy"] == "Never" and spec["serviceAccountName"] == "default-editor"
    assert spec["nodeSelector"] == {"pool": "gpu"} and spec["tolerations"][0]["key"] == "nvidia.com/gpu"
    env = {e["name"]: e for e in spec["containers"][0]["env"]}
    # Optional: a cluster with web identity has no store Secret, the worker takes the AWS credential chain.
    ak = {"name": "store-secret", "key": "accesskey", "optional": True}
    assert env["AK"]["valueFrom"]["secretKeyRef"] == ak
    assert env["RK"]["valueFrom"]["secretKeyRef"]["optional"] is True
    assert env["DDILOCO_POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert spec["containers"][0]["resources"] == {"requests": {"cpu": "4"}, "limits": {"nvidia.com/gpu": "1"}}


def test_workflow_stopped_reads_kfp_terminate_and_deadlines():
    assert workflow_stopped({"spec": {"activeDeadlineSeconds": 0}}, 0.0)
    assert workflow_stopped({"spec": {"shutdown": "Terminate"}}, 0.0)
    wf = {"spec": {"activeDeadlineSeconds": 60}, "status": {"startedAt": "2026-01-01T00:00:00Z"}}
    assert not workflow_stopped(wf, 1767225600.0 + 59) and workflow_stopped(wf, 1767225600.0 + 60)
    assert not workflow_stopped({"spec": {}}, 0.0) and not workflow_stopped(None, 0.0)


class Pods:
    """An in-memory pod table: each created worker follows the script of endings given for its incarnation."""

    def __init__(self, endings, existing=()):
        self.endings, self.pods, self.created, self.deleted = list(endings), {}, [], []
        self.pods[KEEPER_POD["metadata"]["name"]] = KEEPER_POD
        for p in existing:
            self.pods[p["metadata"]["name"]] = p

    def get(self, name):
        return copy.deepcopy(self.pods.get(name))

    def list(self, selector):
        return [copy.deepcopy(p) for n, p in self.pods.items() if n != KEEPER_POD["metadata"]["name"]]

    def create(self, body):
        """The worker ends as scripted by the time the keeper first looks (None: its pod object is gone)."""
        assert body["metadata"]["labels"]["ddiloco.io/incarnation"] == str(len(self.created))
        self.created.append(body["metadata"]["name"])
        end = self.endings.pop(0)
        if end is not None:
            self.pods[body["metadata"]["name"]] = {**end, "metadata": body["metadata"]}
        return body

    def delete(self, name, grace_s=None):
        self.deleted.append((name, grace_s))
        return self.pods.pop(name, None) is not None

    def retire(self, name):
        """KubePods.retire: an ended worker pod stays."""

    def workflow(self, name):
        return {"spec": {}}


def keeper(pods, crash_restarts=1, infra_restarts=5):
    return Keeper(
        pods, Slot("learner", "run", 0), SPEC, KEEPER_POD["metadata"]["name"], crash_restarts=crash_restarts,
        infra_restarts=infra_restarts, backoff_s=0, poll_s=0, sleep=lambda s: None,
    )  # fmt: skip


def test_the_keeper_restarts_after_infrastructure_failures_and_succeeds():
    pods = Pods(
        [
            CASES["preempt"][0],
            CASES["evict"][0],
            None,
            CASES["oom"][0],
            CASES["admission"][0],
            CASES["succeeded"][0],
        ]
    )
    keeper(pods).run()
    assert len(pods.created) == 6


def test_the_keeper_counts_crashes_against_crash_restarts_and_never_restarts_a_usage_error():
    pods = Pods([CASES["crash"][0], CASES["preempt"][0], CASES["crash"][0]])
    with pytest.raises(KeeperFailed, match="crash_restarts=1"):
        keeper(pods).run()
    assert len(pods.created) == 3
    pods = Pods([CASES["usage error"][0]])
    with pytest.raises(KeeperFailed, match="usage error"):
        keeper(pods).run()
    assert len(pods.created) == 1


def test_the_keeper_gives_up_past_the_infrastructure_limit():
    pods = Pods([CASES["evict"][0]] * 3)
    with pytest.raises(KeeperFailed, match="limit of 2"):
        keeper(pods, infra_restarts=2).run()


def test_a_retried_keeper_adopts_the_live_worker_instead_of_starting_another():
    slot = Slot("learner", "run", 0)
    live = {**worker_manifest(slot, 2, SPEC, KEEPER_POD), "status": {"phase": "Running"}}
    pods = Pods([], existing=[live])
    script = iter([{"phase": "Running"}, {"phase": "Succeeded"}])
    orig_get = pods.get

    def get(name):
        if name == live["metadata"]["name"]:
            pods.pods[name]["status"] = next(script)
        return orig_get(name)

    pods.get = get
    keeper(pods).run()
    assert pods.created == []  # adopted, never a second learner 0


def test_a_retried_keeper_whose_worker_already_succeeded_exits_at_once():
    done = {
        **worker_manifest(Slot("learner", "run", 0), 1, SPEC, KEEPER_POD),
        "status": {"phase": "Succeeded"},
    }
    pods = Pods([], existing=[done])
    keeper(pods).run()
    assert pods.created == []


def test_sigterm_deletes_the_own_pod_and_the_worker_only_when_the_run_stops():
    pods = Pods([])
    k = keeper(pods)
    k.own, k.worker = KEEPER_POD, "w-3"
    k.on_sigterm()
    assert pods.deleted == [(KEEPER_POD["metadata"]["name"], 0)]
    pods = Pods([])
    pods.workflow = lambda name: {"spec": {"activeDeadlineSeconds": 0}}  # KFP TerminateRun
    k = keeper(pods)
    k.own, k.worker = KEEPER_POD, "w-3"
    k.on_sigterm()
    assert pods.deleted == [(KEEPER_POD["metadata"]["name"], 0), ("w-3", None)]


def test_the_keeper_labels_are_the_chaos_step_labels():
    from ddiloco.components import keeper as k

    assert (k.ROLE_LABEL, k.WORKFLOW_LABEL) == (ROLE_LABEL, WORKFLOW_LABEL)


def test_a_worker_with_shm_gets_a_memory_backed_dev_shm_the_api_accepts():
    """`WorkerSpec.shm` (GPU learners): an emptyDir of medium Memory at /dev/shm, the mount naming the volume
    (the twin's API stand-in refuses a mount without one, as validation.go validateVolumeMounts does)."""
    from tests.twin.workers import pod_spec

    m = worker_manifest(Slot("learner", "r", 0), 1, dataclasses.replace(SPEC, shm="4Gi"), KEEPER_POD)
    assert m["spec"]["volumes"] == [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "4Gi"}}]
    assert m["spec"]["containers"][0]["volumeMounts"] == [{"name": "dshm", "mountPath": "/dev/shm"}]
    assert pod_spec(m).mounts == [{"name": "dshm", "mountPath": "/dev/shm"}]
    plain = worker_manifest(Slot("learner", "r", 0), 1, SPEC, KEEPER_POD)
    assert "volumes" not in plain["spec"] and "volumeMounts" not in plain["spec"]["containers"][0]
    del m["spec"]["volumes"]
    with pytest.raises(ValueError, match=r'volumeMounts\[0\].name: Not found: "dshm"'):
        pod_spec(m)


@pytest.mark.parametrize("shm", ["", "4Gi"])
def test_the_worker_pod_validates_strictly_against_the_kubernetes_schema(shm):
    """What the keeper POSTs is a v1 Pod the API server's schema accepts, field names and types included
    (kubernetes-validate --strict, the oldest and newest Kubernetes the manifests are checked against)."""
    from tests.unit.test_manifests import K8S_VERSIONS, validate_strict

    pod = worker_manifest(Slot("learner", "r", 0), 1, dataclasses.replace(SPEC, shm=shm), KEEPER_POD)
    for version in K8S_VERSIONS:
        validate_strict(pod, version)
