"""A multi-node learner as a Kubeflow Trainer `TrainJob`: its manifest, and how it stands, as pure functions of
the JSON of the TrainJob and of its node pods. `keeper_loop.KubeTrainJobs` serves them to the keeper loop.

With `ClusterOptions.learner_nodes` = N > 1 one learner is one torch job over N pods (nodes) of G =
`gpus_per_learner` ranks each. Its keeper creates a TrainJob (`trainer.kubeflow.org/v1alpha1`) on the
`torch-distributed` ClusterTrainingRuntime where it would create a worker pod; the Trainer controller makes a
JobSet of it (same name, the TrainJob its controller owner: kubeflow/trainer pkg/runtime/framework/plugins/
jobset/jobset.go Build), whose one replicated job `node` is an Indexed Job of N pods (parallelism = completions
= numNodes: jobset.go syncParallelCount; Indexed: jobset pkg/webhooks/jobset_webhook.go Default).

Design choices:
- The manifest (`trainjob_manifest`) is the worker pod's, moved into the TrainJob's fields:
  * `spec.trainer.command` is `torchrun -m ddiloco.cli learner --store … --learner-id …`. The torch runtime
    runs the command as given: it only sets PET_NNODES (numNodes), PET_NPROC_PER_NODE (numProcPerNode, else
    "auto"), PET_NODE_RANK (downward API of the Job's completion-index annotation), PET_MASTER_ADDR
    (`{name}-node-0-0.{name}`: node 0 behind the JobSet's headless service) and PET_MASTER_PORT (29500) on
    the `node` container (pkg/runtime/framework/plugins/torch/torch.go EnforceMLPolicy; the names and the
    port in pkg/constants/constants.go), and torchrun reads every option `--x-y` it is not given from
    `PET_X_Y` (torch/distributed/argparse_util.py `env`). Rank = node rank × G + local rank, WORLD_SIZE =
    N × G (`train.ranks` must allow it: ddiloco.learner.loop refuses more ranks than that).
  * `numProcPerNode` = G always: left out, torch.go derives it from the CPU request on a node without GPUs
    (getNumCPUPerNode: 4 ranks for learner_cpu 4). `resourcesPerNode` = the worker pod's requests and
    limits (the GPUs of one node).
  * `env` = the worker pod's env (store Secret, run key, downward API): a node pod reads it as a worker
    pod does. The PET_* names are reserved: torch.go Validate rejects a TrainJob that sets them.
  * Node pod labels, nodeSelector, tolerations, the service account and the memory-backed /dev/shm
    (`keeper.shm_volume`: a volume and the `node` container's mount) go through `runtimePatches` (pkg/apis/
    trainer/v1alpha1/trainjob_types.go PodSpecPatch; the manager is a domain-prefixed path: jobset.go
    Validate): the node pods carry the worker labels (role, run, learner id, incarnation, the Workflow), so
    the chaos step's kills hit learner nodes as they hit worker pods.
  * The TrainJob carries the worker's name, labels and owners (keeper pod + Workflow,
    `keeper.owner_references`): garbage-collected with the run, its JobSet, Jobs and pods with it.
- How it stands (`as_worker`) is answered in the shape of a worker pod, so `keeper.classify` and `keeper.pick`
  decide for TrainJobs as they do for pods:
  * a deletionTimestamp -> Running and being deleted (a foreground delete: its pods are still going);
  * condition Complete=True -> Succeeded; Failed=True -> Failed. jobset.go Status copies the JobSet's
    Completed / Failed conditions under these names (reason AllJobsCompleted / FailedJobs: jobset
    pkg/constants/constants.go, failure_policy.go executeFailurePolicy);
  * a node lost (`lost_node`) -> Failed with that node pod's status: a DisruptionTarget condition or
    deletionTimestamp, a Failed pod, a container the kubelet restarted in place (restartCount, lastState),
    or a pod gone or replaced at its completion index (another uid than the one first seen) -> the keeper
    classifies it as it classifies a worker pod; infrastructure evidence wins over a crash, since peers of a
    lost node crash on their broken collectives right after;
  * else Running once every node has a running pod, Pending before.
  Under torchrun a rank's exit 2 (usage error) reaches the pod as torchrun's exit 1: a crash, restarted up
  to crash_restarts, unlike a single-pod worker.
- A lost node restarts the whole learner as the keeper's next incarnation, a new TrainJob; JobSet's
  `failurePolicy.maxRestarts` is not used:
  * the stock `torch-distributed` runtime has no failurePolicy (manifests/base/runtimes/torch_distributed.yaml)
    and a TrainJob cannot add one (`runtimePatches` reach only the replicated jobs: trainjob_types.go
    JobSetSpecPatch). Without one, a failed child Job fails the JobSet at once (jobset failure_policy.go
    executeFailurePolicy, FailedJobs); maxRestarts would need a cluster-scoped runtime of our own, and its
    restarts (failurePolicyRecreateAll) would be invisible to the keeper's budgets;
  * below the JobSet the Job controller replaces a lost pod at its index and the kubelet restarts a crashed
    container in place (jobset_webhook.go Default: restartPolicy OnFailure; the Job's default backoffLimit,
    6, counts both): one node would come back alone into a static torchrun rendezvous the others have left;
  * so the first lost node ends the incarnation: the keeper deletes the TrainJob (`retire`, propagationPolicy
    Foreground: the TrainJob stays, with a deletionTimestamp, until the garbage collector removed its JobSet,
    Jobs and pods), waits for it to go as for a terminating worker pod, and creates incarnation n+1, whose
    ranks start together and rejoin from the learner's checkpoint. Crash and infrastructure restarts count
    against the same limits as a worker pod's; a retried keeper cannot count its predecessor's (their
    TrainJobs are deleted, where ended worker pods stay), so its budgets start again.
- Cluster settings (`podsettings`): the node pods opt out of Istio injection (pod template labels and
  annotations), run with the `restricted` securityContext (PodSpecPatch.securityContext for the pod,
  ContainerPatch.securityContext for `node`), and get the run's affinity and imagePullSecrets
  (PodSpecPatch.affinity, .imagePullSecrets). The Kueue queue label goes on the TrainJob itself: Kueue's
  TrainJob integration suspends it (`spec.suspend`) until its queue admits the whole of it. PodSpecPatch has
  no priorityClassName (trainjob_types.go): a TrainJob's node pods take the runtime's; under Kueue the
  workload's priority is the label `kueue.x-k8s.io/priority-class` (a WorkloadPriorityClass), which
  `pod_settings.labels` can carry.
- A suspended TrainJob (`spec.suspend: true`, condition Suspended) reads as a Pending worker whose message
  says it waits for admission: the keeper logs it and waits, it does not fail.
- The node pods are listed by the JobSet's `jobset.sigs.k8s.io/jobset-name` label (jobset api
  jobset_types.go JobSetNameKey, set on every pod by jobset_controller.go labelAndAnnotateObject) and told
  apart by `batch.kubernetes.io/job-completion-index` (the Indexed Job's annotation, also the source of
  PET_NODE_RANK).
- Logs: rank 0 ships the learner's log to the run root itself (`ddiloco.tracking.logship`), as in a worker pod; the
  other ranks' output stays in their pods' logs. The keeper ships nothing.
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
