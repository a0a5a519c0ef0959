"""A multi-node learner as a Kubeflow Trainer `TrainJob`: its manifest, and how it stands, as pure functions of
the JSON of the TrainJob and of its node pods. `keeper_loop.KubeTrainJobs` serves them to the keeper loop.

With `ClusterOptions.learner_nodes` = N > 1 a learner is one torchrun job over N node pods of
`gpus_per_learner` ranks each, on the `torch-distributed` runtime. `trainjob_manifest` moves the worker pod's
command, resources, env, labels and pod settings into the TrainJob's fields and `runtimePatches`. `as_worker`
answers in the shape of a worker pod, so `keeper.classify` and `keeper.pick` decide for TrainJobs as for pods:
a lost node fails the incarnation with that node pod's status, and a suspended TrainJob (Kueue) is Pending.
A lost node restarts the whole learner as the keeper's next incarnation, a new TrainJob, since one node coming
back alone cannot rejoin a static torchrun rendezvous; JobSet's own restarts are not used.

Design notes (the Trainer and JobSet code each choice follows): docs/internals.md, "Multi-node learners as
TrainJobs".
"""

from __future__ import annotations

from typing import Any

from ddiloco.components.keeper import (
    CRASH,
    INFRA,
    USAGE,
    Slot,
    WorkerSpec,
    classify,
    disruption,
    owner_references,
    placement,
    resources_of,
    shm_volume,
)
from ddiloco.components.podsettings import QUEUE_LABEL, container_security_context

GROUP, VERSION, PLURAL, KIND = "trainer.kubeflow.org", "v1alpha1", "trainjobs", "TrainJob"
RUNTIME = "torch-distributed"
"""The ClusterTrainingRuntime a TrainJob names (kubeflow/trainer manifests/base/runtimes/torch_distributed.yaml)."""
NODE = "node"
"""The trainer's replicated job and container name (kubeflow/trainer pkg/constants/constants.go Node)."""
PATCH_MANAGER = "ddiloco.io/keeper"
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
TORCHRUN_ENV = ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT")
"""Set by the torch runtime on the node container, reserved in `spec.trainer.env` (torch.go)."""
MASTER_PORT = 29500
"""kubeflow/trainer constants.go ContainerTrainerPort: PET_MASTER_PORT."""


def trainjob_command(command: list[str]) -> list[str]:
    """`python3 -m ddiloco.cli learner …` (the worker pod's command) as torchrun's: `torchrun -m ddiloco.cli …`."""
    if command[:2] != ["python3", "-m"]:
        raise ValueError(f"a TrainJob runs a module under torchrun; got command {command[:3]}")
    return ["torchrun", *command[1:]]


def trainjob_manifest(
    slot: Slot,
    incarnation: int,
    spec: WorkerSpec,
    keeper_pod: dict[str, Any],
    *,
    nodes: int,
    procs_per_node: int,
) -> dict[str, Any]:
    """The TrainJob of one incarnation of a multi-node learner (module docstring)."""
    meta = keeper_pod["metadata"]
    workflow = (meta.get("labels") or {}).get("workflows.argoproj.io/workflow", "")
    reserved = sorted({e["name"] for e in spec.env} & set(TORCHRUN_ENV))
    if reserved:
        raise ValueError(f"the torch runtime sets {reserved} itself: leave them out of the worker's env")
    settings, labels = spec.settings, slot.labels(incarnation, workflow)
    trainer: dict[str, Any] = {
        "image": spec.image,
        "command": trainjob_command(spec.command),
        "numNodes": nodes,
        "numProcPerNode": procs_per_node,
    }
    if spec.env:
        trainer["env"] = [dict(e) for e in spec.env]
    resources = resources_of(spec)
    if resources:
        trainer["resourcesPerNode"] = resources
    pod_spec = {**placement(spec, keeper_pod), **settings.pod_spec(priority=False)}
    node: dict[str, Any] = {"name": NODE, "securityContext": container_security_context()}
    volumes, mounts = shm_volume(spec)
    if volumes:  # PodSpecPatch.volumes and ContainerPatch.volumeMounts (trainjob_types.go)
        pod_spec["volumes"] = volumes
        node["volumeMounts"] = mounts
    pod_spec["containers"] = [node]  # ContainerPatch: securityContext, volumeMounts
    pod_meta = {
        "labels": settings.pod_labels(labels, queue=False),
        "annotations": settings.pod_annotations({}),
    }
    pod_template: dict[str, Any] = {"metadata": pod_meta, "spec": pod_spec}
    node_job = {"name": NODE, "template": {"spec": {"template": pod_template}}}
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": KIND,
        "metadata": {
            "name": slot.name(incarnation),
            "namespace": meta["namespace"],
            "labels": {
                **settings.labels,
                **labels,
                **({QUEUE_LABEL: settings.queue} if settings.queue else {}),
            },
            "annotations": {**settings.annotations, "ddiloco.io/keeper-pod": meta["name"]},
            "ownerReferences": owner_references(keeper_pod),
        },
        "spec": {
            "runtimeRef": {"name": RUNTIME, "apiGroup": GROUP, "kind": "ClusterTrainingRuntime"},
            "trainer": trainer,
            "runtimePatches": [
                {
                    "manager": PATCH_MANAGER,
                    "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [node_job]}}},
                }
            ],
        },
    }


def node_index(pod: dict[str, Any]) -> str:
    meta = pod.get("metadata") or {}
    return (meta.get("annotations") or {}).get(COMPLETION_INDEX) or (meta.get("labels") or {}).get(
        COMPLETION_INDEX, "?"
    )


def _condition(trainjob: dict[str, Any], kind: str) -> dict[str, Any] | None:
    for cond in (trainjob.get("status") or {}).get("conditions") or []:
        if cond.get("type") == kind and cond.get("status") == "True":
            return cond
    return None


def _node_ending(pod: dict[str, Any]) -> dict[str, Any] | None:
    """The pod-shaped ending of one node pod, None while it runs (or has succeeded)."""
    status = pod.get("status") or {}
    if disruption(pod) or status.get("phase") == "Failed":
        return {"metadata": pod.get("metadata") or {}, "status": {**status, "phase": "Failed"}}
    for cs in status.get("containerStatuses") or []:
        last = (cs.get("lastState") or {}).get("terminated")
        if cs.get("restartCount", 0) > 0 and last:  # restartPolicy OnFailure: restarted in place
            return {
                "metadata": pod.get("metadata") or {},
                "status": {"phase": "Failed", "containerStatuses": [{**cs, "state": {"terminated": last}}]},
            }
    return None


def lost_node(pods: list[dict[str, Any]], seen: dict[str, str]) -> tuple[dict[str, Any] | None, str]:
    """The first lost node of a TrainJob as a pod-shaped ending, and what happened to it (None, "" when none).
    `seen` (completion index -> pod uid, the first pod seen there) is updated in place."""
    current: dict[str, list[dict[str, Any]]] = {}
    for pod in pods:
        idx = node_index(pod)
        current.setdefault(idx, []).append(pod)
        seen.setdefault(idx, (pod.get("metadata") or {}).get("uid", ""))
    endings: list[tuple[dict[str, Any], str]] = []
    for idx, uid in sorted(seen.items()):
        mine = [p for p in current.get(idx, []) if (p.get("metadata") or {}).get("uid", "") == uid]
        if not mine:
            gone = {"status": {"phase": "Failed", "reason": "NodeLost"}}
            endings.append((gone, f"node {idx}: its pod is gone (deleted, or its node lost)"))
            continue
        ending = _node_ending(mine[0])
        if ending is not None:
            name = mine[0]["metadata"].get("name", "")
            endings.append((ending, f"node {idx} (pod {name}): {classify(ending).why}"))
    order = {INFRA: 0, USAGE: 1, CRASH: 2}
    endings.sort(key=lambda e: order.get(classify(e[0]).state, 3))
    return endings[0] if endings else (None, "")


def as_worker(trainjob: dict[str, Any], pods: list[dict[str, Any]], seen: dict[str, str]) -> dict[str, Any]:
    """The TrainJob in the shape of a worker pod (module docstring, "How it stands")."""
    meta = trainjob.get("metadata") or {}
    if meta.get("deletionTimestamp"):
        return {"metadata": meta, "status": {"phase": "Running"}}
    if _condition(trainjob, "Complete"):
        return {"metadata": meta, "status": {"phase": "Succeeded"}}
    if (trainjob.get("spec") or {}).get("suspend"):
        queue = (meta.get("labels") or {}).get(QUEUE_LABEL, "")
        why = f"suspended: waiting for Kueue to admit it (queue {queue!r})" if queue else "suspended"
        return {"metadata": meta, "status": {"phase": "Pending", "message": why}}
    ending, why = lost_node(pods, seen)
    failed = _condition(trainjob, "Failed")
    if ending is None and failed is None:
        nodes = int(((trainjob.get("spec") or {}).get("trainer") or {}).get("numNodes", 1))
        running = {node_index(p) for p in pods if (p.get("status") or {}).get("phase") == "Running"}
        return {"metadata": meta, "status": {"phase": "Running" if len(running) >= nodes else "Pending"}}
    if ending is None:
        assert failed is not None
        ending = {"status": {"phase": "Failed", "reason": failed.get("reason", "")}}
        why = f"TrainJob Failed: {failed.get('message', '')}"
    status = {**ending["status"], "message": why}
    return {"metadata": meta, "status": status}
