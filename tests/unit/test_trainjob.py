"""A multi-node learner's TrainJob (ddiloco.components.trainjob): the manifest against the Kubeflow Trainer rules
it relies on, how a TrainJob and its node pods read as a worker, and the keeper loop keeping TrainJobs."""

from __future__ import annotations

import copy
import dataclasses
import os
import re
from unittest import mock

import pytest
from ddiloco.components import trainjob as tj
from ddiloco.components.keeper import CRASH, INFRA, RUNNING, SUCCEEDED, Slot, classify, pick, worker_manifest
from ddiloco.components.keeper_loop import Keeper
from ddiloco.components.podsettings import container_security_context, pod_security_context

from tests.unit.test_keeper import KEEPER_POD, SPEC, term

SLOT = Slot("learner", "3f2a-run", 1)


def manifest(n: int = 0) -> dict:
    return tj.trainjob_manifest(SLOT, n, SPEC, KEEPER_POD, nodes=2, procs_per_node=4)


def test_the_trainjob_names_the_torch_runtime_and_carries_the_workers_fields():
    """kubeflow/trainer manifests/base/runtimes/torch_distributed.yaml: ClusterTrainingRuntime
    `torch-distributed`, replicated job and container `node` (pkg/constants/constants.go Node);
    trainjob_types.go: numNodes, numProcPerNode, resourcesPerNode, env, image, command; the name a DNS-1035
    label of at most 63 characters (TrainJob XValidation)."""
    m, pod = manifest(3), worker_manifest(SLOT, 3, SPEC, KEEPER_POD)
    assert (m["apiVersion"], m["kind"]) == ("trainer.kubeflow.org/v1alpha1", "TrainJob")
    assert m["spec"]["runtimeRef"] == {
        "name": "torch-distributed",
        "apiGroup": "trainer.kubeflow.org",
        "kind": "ClusterTrainingRuntime",
    }
    name = m["metadata"]["name"]
    assert name == pod["metadata"]["name"] and re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name)
    assert len(name) <= 63
    for key in ("ownerReferences", "namespace"):  # collected with the Workflow, like a worker
        assert m["metadata"][key] == pod["metadata"][key]
    assert m["metadata"]["labels"] == {  # the Istio opt-out is the node pods' (a TrainJob is no pod)
        k: v for k, v in pod["metadata"]["labels"].items() if k != "sidecar.istio.io/inject"
    }
    trainer = m["spec"]["trainer"]
    assert (trainer["numNodes"], trainer["numProcPerNode"], trainer["image"]) == (2, 4, SPEC.image)
    assert trainer["resourcesPerNode"] == {"requests": {"cpu": "4"}, "limits": {"nvidia.com/gpu": "1"}}
    assert trainer["env"] == pod["spec"]["containers"][0]["env"]
    assert trainer["command"] == ["torchrun", "-m", "ddiloco.cli", "learner"]


def test_node_pods_get_the_worker_labels_pool_and_account_through_a_runtime_patch():
    """trainjob_types.go RuntimePatch -> JobSetSpecPatch.replicatedJobs[name] -> PodTemplatePatch (labels) and
    PodSpecPatch (nodeSelector, tolerations, serviceAccountName); jobset.go Validate: the manager is a
    domain-prefixed path, the replicated job exists in the runtime."""
    (patch,) = manifest()["spec"]["runtimePatches"]
    assert re.fullmatch(r"[a-z0-9.-]+/[a-z0-9.-]+", patch["manager"])
    (rjob,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    assert rjob["name"] == "node"
    template = rjob["template"]["spec"]["template"]
    assert template["metadata"]["labels"] == {  # the chaos step's selector, and the Istio opt-out
        **manifest()["metadata"]["labels"],
        "sidecar.istio.io/inject": "false",
    }
    assert template["metadata"]["annotations"] == {"sidecar.istio.io/inject": "false"}
    assert template["spec"] == {
        "nodeSelector": {"pool": "gpu"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}],
        "serviceAccountName": "default-editor",
        "securityContext": pod_security_context(),  # PodSpecPatch.securityContext
        "containers": [{"name": "node", "securityContext": container_security_context()}],
    }
    assert "env" not in str(patch)  # jobset.go Validate: no env for the `node` container in a patch


def test_the_torchrun_variables_are_the_runtimes_and_never_in_the_trainjobs_env():
    """torch.go Validate refuses PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK, PET_MASTER_ADDR and
    PET_MASTER_PORT in spec.trainer.env (constants.go TorchRunReservedEnvNames): the runtime sets them."""
    assert not {e["name"] for e in manifest()["spec"]["trainer"]["env"]} & set(tj.TORCHRUN_ENV)
    bad = dataclasses.replace(SPEC, env=[*SPEC.env, {"name": "PET_NNODES", "value": "3"}])
    with pytest.raises(ValueError, match="PET_NNODES"):
        tj.trainjob_manifest(SLOT, 0, bad, KEEPER_POD, nodes=2, procs_per_node=1)
    with pytest.raises(ValueError, match="torchrun"):
        tj.trainjob_command(["bash", "-c", "x"])


def test_torchrun_takes_its_rendezvous_from_the_runtimes_pet_variables():
    """The torch runtime does not wrap the command: torch.go EnforceMLPolicy only sets PET_* on the node
    container, and torchrun reads each option it is not given from PET_<OPTION> (torch/distributed/
    argparse_util.py env): this torch's own parser, with the variables node 1 of 2 gets."""
    from torch.distributed.run import get_args_parser

    env = {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "4", "PET_NODE_RANK": "1",
           "PET_MASTER_ADDR": "ddiloco-learner-1-x-0-node-0-0.ddiloco-learner-1-x-0",
           "PET_MASTER_PORT": str(tj.MASTER_PORT)}  # fmt: skip
    with mock.patch.dict(os.environ, env):
        args = get_args_parser().parse_args(manifest()["spec"]["trainer"]["command"][1:])
    assert (args.nnodes, args.nproc_per_node, args.node_rank) == ("2", "4", 1)
    assert (args.master_addr, args.master_port) == (env["PET_MASTER_ADDR"], 29500)
    assert args.module and args.training_script == "ddiloco.cli" and args.training_script_args == ["learner"]
    assert args.rdzv_backend == "static"  # node 0's agent hosts the store: all nodes must start together


# --- how a TrainJob and its node pods read as a worker -------------------------------------------------------
def node(k, uid=None, phase="Running", restarts=0, last=None, conditions=(), deleting=False):
    meta = {
        "name": f"j-node-0-{k}-abcde",
        "uid": uid or f"u{k}",
        "annotations": {tj.COMPLETION_INDEX: str(k)},
    }
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:05Z"
    cs = {"name": "node", "restartCount": restarts, "state": {"running": {}}}
    if last is not None:
        cs["lastState"] = {"terminated": last}
    status = {"phase": phase, "containerStatuses": [cs]}
    if conditions:
        status["conditions"] = list(conditions)
    return {"metadata": meta, "status": status}


def job(*conditions, deleting=False, n=0):
    body = manifest(n)
    if deleting:
        body["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:05Z"
    if conditions:
        body["status"] = {"conditions": [{"type": c, "status": "True", "reason": r, "message": m} for c, r, m in conditions]}  # fmt: skip
    return body


COMPLETE = ("Complete", "AllJobsCompleted", "jobset completed successfully")
FAILED = (
    "Failed",
    "FailedJobs",
    "jobset failed due to one or more job failures (first failed job: j-node-0)",
)
DISRUPTED = {"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI"}


def state(trainjob, pods, seen=None):
    return classify(tj.as_worker(trainjob, pods, {} if seen is None else seen))


def test_a_trainjob_stands_as_its_conditions_and_its_node_pods_say():
    """jobset.go Status: the JobSet's Completed / Failed become the TrainJob's Complete / Failed."""
    both = [node(0), node(1)]
    assert (
        state(job(), both).state == RUNNING and tj.as_worker(job(), both, {})["status"]["phase"] == "Running"
    )
    assert tj.as_worker(job(), [node(0)], {})["status"]["phase"] == "Pending"
    assert state(job(COMPLETE), []).state == SUCCEEDED
    assert state(job(FAILED), []).state == INFRA  # pods gone: nothing says it crashed
    finished = node(1, phase="Succeeded")
    assert state(job(), [node(0), finished]).state == RUNNING  # node 1 done first: not lost
    going = tj.as_worker(job(FAILED, deleting=True), both, {})
    assert classify(going).state == RUNNING and going["metadata"]["deletionTimestamp"]  # foreground delete
    assert pick([going]).terminating == [going["metadata"]["name"]]


def test_a_lost_node_ends_the_incarnation_and_the_infrastructure_wins_over_its_peers_crash():
    seen: dict = {}
    assert state(job(), [node(0), node(1)], seen).state == RUNNING and seen == {"0": "u0", "1": "u1"}
    replaced = state(job(), [node(0), node(1, uid="u1b")], seen)  # the Job replaced index 1
    assert replaced.state == INFRA and "node 1" in replaced.why, replaced
    assert state(job(), [node(0)], dict(seen)).state == INFRA  # index 1 gone, not replaced yet
    crashed = node(0, restarts=1, last=term(1))  # OnFailure: rank 0 restarted in place after the loss
    both = state(job(), [crashed, node(1, uid="u1b")], dict(seen))
    assert both.state == INFRA and "node 1" in both.why
    assert state(job(), [crashed, node(1)], dict(seen)).state == CRASH
    oom = node(1, restarts=1, last=term(137, "OOMKilled"))
    assert state(job(), [node(0), oom], dict(seen)).state == INFRA
    assert state(job(), [node(0), node(1, conditions=[DISRUPTED])], dict(seen)).state == INFRA
    assert state(job(), [node(0), node(1, deleting=True)], dict(seen)).state == INFRA
    evicted = {**node(1, phase="Failed"), "status": {"phase": "Failed", "reason": "Evicted"}}
    assert state(job(), [node(0), evicted], dict(seen)).state == INFRA


# --- the keeper loop keeping TrainJobs ------------------------------------------------------------------------
class TrainJobTable:
    """KubeTrainJobs in memory: each created TrainJob's node pods follow the script given for its incarnation;
    a retired TrainJob is deleted in the foreground and gone after the keeper looked at it once."""

    def __init__(self, scripts, existing=()):
        self.scripts, self.jobs, self.pods, self.seen = list(scripts), {}, {}, {}
        self.created, self.retired = [], []
        for body, pods in existing:
            self.jobs[body["metadata"]["name"]], self.pods[body["metadata"]["name"]] = body, pods

    def _view(self, name):
        return tj.as_worker(self.jobs[name], self.pods[name], self.seen.setdefault(name, {}))

    def get(self, name):
        return self._view(name) if name in self.jobs else None

    def list(self, selector):
        out = [self._view(n) for n in self.jobs]
        for name in [n for n, j in self.jobs.items() if j["metadata"].get("deletionTimestamp")]:
            del self.jobs[name]  # the garbage collector finished the foreground delete
        return out

    def create(self, body):
        assert body["kind"] == "TrainJob" and body["spec"]["trainer"]["numNodes"] == 2
        name = body["metadata"]["name"]
        self.created.append(name)
        first, *later = self.scripts.pop(0)
        self.jobs[name], self.pods[name], self.later = copy.deepcopy(body), first, later
        return body

    def tick(self, name):
        """The node pods move on to the next step of their script."""
        if self.later and name in self.jobs and not self.jobs[name]["metadata"].get("deletionTimestamp"):
            step = self.later.pop(0)
            self.pods[name] = step if isinstance(step, list) else self.pods[name]
            if isinstance(step, tuple):
                self.jobs[name]["status"] = {
                    "conditions": [{"type": step[0], "status": "True", "reason": step[1]}]
                }

    def delete(self, name, grace_s=None):
        if name in self.jobs:
            self.jobs[name]["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:09Z"
        return True

    def retire(self, name):
        self.retired.append(name)
        self.delete(name)


class OwnPod:
    def get(self, name):
        return copy.deepcopy(KEEPER_POD)


def trainjob_keeper(table, **kw):
    def sleep(_s):
        for name in list(table.jobs):
            table.tick(name)

    return Keeper(
        OwnPod(), SLOT, SPEC, KEEPER_POD["metadata"]["name"], crash_restarts=1, infra_restarts=5, backoff_s=0,
        poll_s=0, sleep=sleep, workers=table,
        manifest=lambda *a: tj.trainjob_manifest(*a, nodes=2, procs_per_node=1), **kw,
    )  # fmt: skip


def test_the_keeper_restarts_a_trainjob_that_lost_a_node_as_a_whole_new_one():
    table = TrainJobTable([
        [[node(0), node(1)], [node(0), node(1, uid="u1-replaced")]],  # incarnation 0: node 1 lost
        [[node(0, uid="v0"), node(1, uid="v1")], COMPLETE],  # incarnation 1: completes
    ])  # fmt: skip
    trainjob_keeper(table).run()
    assert table.created == [SLOT.name(0), SLOT.name(1)]
    assert table.retired == [SLOT.name(0)]  # deleted in the foreground before incarnation 1 started


def test_a_retried_keeper_retires_an_ended_trainjob_before_it_starts_the_next():
    lost = (job(n=0), [node(0)])  # its node 1 is gone: the old keeper never deleted it
    table = TrainJobTable([[[node(0), node(1)], COMPLETE]], existing=[lost])
    table.seen[SLOT.name(0)] = {"0": "u0", "1": "u1"}
    trainjob_keeper(table).run()
    assert table.retired == [SLOT.name(0)] and table.created == [SLOT.name(1)]


def test_node_pods_get_the_memory_backed_dev_shm_through_the_runtime_patch():
    """trainjob_types.go PodSpecPatch.volumes and ContainerPatch.volumeMounts of the `node` container (jobset.go
    Validate: a container patch names a runtime container and carries no env); the twin's stand-in merges the
    patch into the node pod by container name, command and image kept."""
    from tests.twin.trainjobs import TrainJobs, _merge_containers, _node_patch
    from tests.twin.workers import pod_spec

    spec = dataclasses.replace(SPEC, shm="4Gi")
    m = tj.trainjob_manifest(SLOT, 0, spec, KEEPER_POD, nodes=2, procs_per_node=4)
    (patch,) = m["spec"]["runtimePatches"]
    (rjob,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    pod = rjob["template"]["spec"]["template"]["spec"]
    assert pod["volumes"] == [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "4Gi"}}]
    assert pod["containers"] == [
        {
            "name": "node",
            "securityContext": container_security_context(),
            "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
        }
    ]
    assert TrainJobs._invalid(None, m) == ""
    node = _node_patch(m)
    base = {"name": "node", "image": "img", "command": ["torchrun"]}
    body = {
        "metadata": {},
        "spec": {"containers": _merge_containers(base, node["containers"]), **node["spec"]},
    }
    got = pod_spec(body)
    assert got.command == ["torchrun"] and got.mounts == [{"name": "dshm", "mountPath": "/dev/shm"}]
    bad = copy.deepcopy(m)
    bad_pod = bad["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
    bad_pod["template"]["spec"]["template"]["spec"]["containers"][0]["env"] = [{"name": "X", "value": "1"}]
    assert "must not have envs" in TrainJobs._invalid(None, bad)
