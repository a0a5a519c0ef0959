"""TrainJobs a step creates through the API stand-in (POST /apis/trainer.kubeflow.org/v1alpha1/namespaces/{ns}/
trainjobs): Kubeflow Trainer's `torch-distributed` runtime, its JobSet and the JobSet's Indexed Job, as far as
a multi-node learner needs them to run; the node pods are the twin's created pods (workers.py).

Design choices:
- The twin knows one runtime, the stock `torch-distributed` ClusterTrainingRuntime; a TrainJob naming another
  is refused (422), as the Trainer webhook refuses a runtime that does not exist.
- TrainJob -> JobSet -> Job -> pods is collapsed into one object here: the node pods are owned by a stand-in
  Job (`{name}-node-0`) whose uid is the TrainJob's, so the garbage collector of workers.py takes them when
  the TrainJob goes; the TrainJob's own owners (keeper pod, Workflow) are checked the same way.
- Node pod k runs the trainer command with the trainer env and the torchrun variables the runtime sets, on
  loopback: PET_MASTER_ADDR is 127.0.0.1 (the stand-in for `{name}-node-0-0.{name}`, the headless service's
  DNS name of node 0) and PET_MASTER_PORT a free port per TrainJob (all pods share one host here, where the
  cluster has 29500 on each pod's own IP). torchrun's workers start in sessions of their own; a node pod's
  processes still all die with it (pods.py kills every process that carries the pod's TWIN_POD_UID).
- Restart policy: a node container that exits non-zero ends its pod Failed, as with `restartPolicy: Never`;
  the runtime's pods have `OnFailure` (JobSet webhook default), where the kubelet restarts the container in
  place. The keeper ends the incarnation on either (components/trainjob.py); the in-place restart is covered
  by its unit tests, not run here.
- Time: the Job's pod replacement and the status follow on the twin's next tick.
- Admission (kueue.py, admission.py): a TrainJob with a queue label is created suspended and starts its node
  pods once its queue admits it; a node pod Pod Security refuses is not created (its message in `refused`)
  and the Job controller tries again on the next tick, so the TrainJob never starts.

Rules and their sources:
- kubeflow/trainer pkg/runtime/framework/plugins/torch/torch.go EnforceMLPolicy: PET_NNODES = numNodes,
  PET_NPROC_PER_NODE = numProcPerNode, PET_NODE_RANK from the downward API of the annotation
  `batch.kubernetes.io/job-completion-index`, PET_MASTER_ADDR / PET_MASTER_PORT; Validate: those names are
  reserved in `spec.trainer.env` (422). pkg/runtime/core/trainingruntime.go newRuntimeInfo: resourcesPerNode
  becomes the `node` container's resources; runtimePatches are strategic-merge patches of the JobSet spec
  (pod template labels, nodeSelector, tolerations, serviceAccountName, volumes here; container patches are
  merged into the `node` container by name: its volumeMounts).
- jobset.go syncParallelCount / jobset_webhook.go Default: one Indexed Job of numNodes pods; pods carry
  `jobset.sigs.k8s.io/jobset-name` and the completion index (jobset_controller.go labelAndAnnotateObject,
  the Job controller's index annotation and label).
- Job controller: a pod of an index that failed or is gone is replaced (a new pod, a new uid) while the
  Job's failures stay within backoffLimit (default 6); past it the Job fails and its running pods are
  deleted. JobSet without failurePolicy: a failed Job fails the JobSet (failure_policy.go
  executeFailurePolicy, reason FailedJobs, message "jobset failed due to one or more job failures (first
  failed job: NAME)"); all Jobs complete -> Completed (AllJobsCompleted). trainer jobset.go Status copies
  them to the TrainJob as Failed / Complete.
- DELETE with propagationPolicy Foreground: the object gets a deletionTimestamp and stays until its dependents
  are gone (garbagecollector.go, foreground deletion); otherwise (Background, the default for a custom
  resource) it goes at once and the garbage collector deletes its pods after.
"""

from __future__ import annotations

import re
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from ddiloco.platform.ports import free_port
from tests.twin import kueue

GROUP_VERSION = "trainer.kubeflow.org/v1alpha1"
RUNTIME = "torch-distributed"
RESERVED = ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT")
INDEX = "batch.kubernetes.io/job-completion-index"
JOBSET_NAME = "jobset.sigs.k8s.io/jobset-name"
BACKOFF_LIMIT = 6
_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def _rfc3339(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class TrainJob:
    body: dict[str, Any]
    uid: str
    created: float
    port: int
    pods: dict[int, str] = field(default_factory=dict)
    """completion index -> name of its current pod."""
    failures: int = 0
    conditions: list[dict[str, Any]] = field(default_factory=list)
    deleting: float | None = None
    refused: list[str] = field(default_factory=list)
    """Why the Job controller could not create a node pod (FailedCreate: Pod Security's message)."""

    @property
    def name(self) -> str:
        return self.body["metadata"]["name"]

    @property
    def trainer(self) -> dict[str, Any]:
        return self.body["spec"].get("trainer") or {}

    @property
    def suspended(self) -> bool:
        return bool(self.body["spec"].get("suspend"))

    @property
    def done(self) -> bool:
        return any(c["type"] in ("Complete", "Failed") for c in self.conditions)

    def json(self) -> dict[str, Any]:
        meta = {**self.body["metadata"], "uid": self.uid, "creationTimestamp": _rfc3339(self.created)}
        if self.deleting is not None:
            meta["deletionTimestamp"] = _rfc3339(self.deleting)
        out = {**self.body, "metadata": meta}
        if self.conditions:
            out["status"] = {"conditions": [dict(c) for c in self.conditions]}
        return out


def _node_patch(body: dict[str, Any]) -> dict[str, Any]:
    """The pod template of replicated job `node` after the runtime patches (merged in order)."""
    out: dict[str, Any] = {"metadata": {"labels": {}}, "spec": {}, "containers": []}
    for patch in body["spec"].get("runtimePatches") or []:
        spec = (((patch.get("trainingRuntimeSpec") or {}).get("template") or {}).get("spec")) or {}
        for rjob in spec.get("replicatedJobs") or []:
            if rjob.get("name") != "node":
                continue
            tmpl = ((rjob.get("template") or {}).get("spec") or {}).get("template") or {}
            out["metadata"]["labels"].update((tmpl.get("metadata") or {}).get("labels") or {})
            out["metadata"].setdefault("annotations", {}).update(
                (tmpl.get("metadata") or {}).get("annotations") or {}
            )
            pod = dict(tmpl.get("spec") or {})
            out["containers"] += pod.pop("containers", None) or []  # ContainerPatch: merged by name
            out["spec"].update(pod)
    return out


def _merge_containers(base: dict[str, Any], patches: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Strategic merge of container patches by name (patchMergeKey `name`): the `node` container gets a
    patch's volumeMounts added (its env is refused by `_invalid`; other fields are not modelled); a patch
    naming another container adds that container."""
    containers = [base]
    for cp in patches:
        if cp.get("name") == base["name"]:
            base["volumeMounts"] = [*(base.get("volumeMounts") or []), *(cp.get("volumeMounts") or [])]
            if cp.get("securityContext"):  # ContainerPatch.securityContext
                base["securityContext"] = {**(base.get("securityContext") or {}), **cp["securityContext"]}
        else:
            containers.append(dict(cp))
    return containers


class TrainJobs:
    """The TrainJobs of one twin run; `ex` is the TwinExecution (its lock held by every caller)."""

    def __init__(self, ex: Any) -> None:
        self.ex = ex
        self.jobs: dict[str, TrainJob] = {}
        self.ended: dict[str, dict[str, Any]] = {}
        """name -> the TrainJob's JSON when it went (kept for tests)."""

    # --- the API ---
    def create(self, namespace: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        meta = body.get("metadata") or {}
        name = meta.get("name", "")
        if meta.get("namespace", namespace) != namespace or not name:
            return 400, {"reason": "BadRequest", "message": "the namespace of the object does not match"}
        if name in self.jobs:
            return 409, {"reason": "AlreadyExists", "message": f'trainjobs.trainer.kubeflow.org "{name}" already exists'}  # fmt: skip
        invalid = self._invalid(body)
        if invalid:
            return 422, {"reason": "Invalid", "message": f'TrainJob.trainer.kubeflow.org "{name}" is invalid: {invalid}'}  # fmt: skip
        body = kueue.suspend(self.ex.cluster.queues, {**body, "metadata": {**meta, "namespace": namespace}})
        job = TrainJob(body, str(uuid.uuid4()), time.time(), free_port())
        self.jobs[name] = job
        if job.suspended:
            job.conditions.append(self._cond("Suspended", "Suspended", "TrainJob is suspended"))
        else:
            self._start_nodes(job)
        return 201, job.json()

    def _start_nodes(self, job: TrainJob) -> None:
        for k in range(int(job.trainer.get("numNodes", 1))):
            self._start_node(job, k)

    def _invalid(self, body: dict[str, Any]) -> str:
        name, spec = body["metadata"]["name"], body.get("spec") or {}
        if len(name) > 63 or not _DNS1035.match(name):
            return "metadata.name must match RFC 1035 DNS label format and be no more than 63 characters"
        ref = spec.get("runtimeRef") or {}
        if (
            ref.get("name") != RUNTIME
            or ref.get("kind", "ClusterTrainingRuntime") != "ClusterTrainingRuntime"
        ):
            return f"spec.runtimeRef: the twin has only the ClusterTrainingRuntime {RUNTIME!r}"
        reserved = sorted(
            {e.get("name") for e in (spec.get("trainer") or {}).get("env") or []} & set(RESERVED)
        )
        if reserved:
            return f"spec.trainer.env: must not have reserved envs, invalid envs configured: {reserved}"
        for patch in spec.get("runtimePatches") or []:  # jobset.go Validate: container patches
            tmpl = ((patch.get("trainingRuntimeSpec") or {}).get("template") or {}).get("spec") or {}
            for rjob in tmpl.get("replicatedJobs") or []:
                pod = (((rjob.get("template") or {}).get("spec") or {}).get("template") or {}).get(
                    "spec"
                ) or {}
                for c in pod.get("containers") or []:
                    if c.get("name") != "node":
                        return "spec.runtimePatches: must not have container that doesn't exist in the runtime job node"
                    if c.get("env"):
                        return "spec.runtimePatches: must not have envs for the dataset-initializer, model-initializer, node containers"
        return ""

    def get(self, name: str) -> dict[str, Any] | None:
        job = self.jobs.get(name)
        return None if job is None else job.json()

    def list(self) -> list[dict[str, Any]]:
        return [j.json() for j in self.jobs.values()]

    def delete(self, name: str, propagation: str | None) -> dict[str, Any] | None:
        job = self.jobs.get(name)
        if job is None:
            return None
        if propagation == "Foreground":
            if job.deleting is None:
                job.deleting = time.time()
                for pod in self._node_pods(job):
                    self.ex.workers.delete(pod, None)
            return job.json()
        body = job.json()
        self._gone(job)  # background: the garbage collector (workers.py) deletes its pods
        return body

    def uids(self) -> set[str]:
        return {j.uid for j in self.jobs.values()}

    # --- the Trainer, JobSet and Job controllers and the garbage collector, once per tick ---
    def poll(self) -> None:
        present = {self.ex.workflow_uid} | {w.uid for w in self.ex.workers.pods.values()}
        present |= {n.state.get("uid") for p, (n, _) in self.ex.pods.items() if p not in self.ex.deleted}
        for job in list(self.jobs.values()):
            owners = [o["uid"] for o in job.body["metadata"].get("ownerReferences") or []]
            if owners and not any(uid in present for uid in owners) and job.deleting is None:
                self.delete(job.name, "Background")
            elif job.deleting is not None:
                if not self._node_pods(job):
                    self._gone(job)
            elif job.suspended:
                self._admit(job)
            elif not job.done:
                self._reconcile(job)

    def _admit(self, job: TrainJob) -> None:
        """Kueue (kueue.py): unsuspend a queued TrainJob once its queue's quota fits all of its nodes."""
        queues, queue = self.ex.cluster.queues or {}, kueue.queue_of(job.body)
        used: dict[str, float] = {}
        for other in self.jobs.values():
            if (
                other is not job
                and kueue.queue_of(other.body) == queue
                and not other.suspended
                and not other.done
            ):
                kueue.add(used, kueue.trainjob_usage(other.body["spec"]))
        if kueue.fits(queues.get(queue), used, kueue.trainjob_usage(job.body["spec"])):
            job.body = {**job.body, "spec": {**job.body["spec"], "suspend": False}}
            job.conditions = [c for c in job.conditions if c["type"] != "Suspended"]
            self._start_nodes(job)

    def _node_pods(self, job: TrainJob) -> list[str]:
        return [w.name for w in self.ex.workers.pods.values() if w.body["metadata"]["labels"].get(JOBSET_NAME) == job.name]  # fmt: skip

    def _gone(self, job: TrainJob) -> None:
        self.ended[job.name] = job.json()
        del self.jobs[job.name]

    def _reconcile(self, job: TrainJob) -> None:
        pods = self.ex.workers.pods
        for k in range(int(job.trainer.get("numNodes", 1))):
            if k not in job.pods:  # refused at admission before: the Job controller tries again
                self._start_node(job, k)
        phases = {k: pods[name].phase if name in pods else "Gone" for k, name in job.pods.items()}
        for k, phase in sorted(phases.items()):
            if phase in ("Failed", "Gone"):
                job.failures += 1
                if job.failures > BACKOFF_LIMIT:
                    self._fail(job)
                    return
                self._start_node(job, k)  # the Job controller replaces the pod of index k
        if phases and all(p == "Succeeded" for p in phases.values()):
            reason, message = "AllJobsCompleted", "jobset completed successfully"
            job.conditions.append(self._cond("Complete", reason, message))

    def _fail(self, job: TrainJob) -> None:
        message = f"jobset failed due to one or more job failures (first failed job: {job.name}-node-0)"
        job.conditions.append(self._cond("Failed", "FailedJobs", message))
        for pod in self._node_pods(job):
            self.ex.workers.delete(pod, None)  # the failed Job deletes its active pods

    @staticmethod
    def _cond(kind: str, reason: str, message: str) -> dict[str, Any]:
        now = _rfc3339(time.time())
        return {
            "type": kind,
            "status": "True",
            "reason": reason,
            "message": message,
            "lastTransitionTime": now,
        }

    def _start_node(self, job: TrainJob, k: int) -> None:
        """Pod k of the JobSet's `node` Job, as the Trainer, JobSet and Job controllers build it."""
        tr, patch = job.trainer, _node_patch(job.body)
        nodes, procs = int(tr.get("numNodes", 1)), tr.get("numProcPerNode", "auto")
        env = [dict(e) for e in tr.get("env") or []] + [
            {"name": "PET_NNODES", "value": str(nodes)},
            {"name": "PET_NPROC_PER_NODE", "value": str(procs)},
            {"name": "PET_NODE_RANK", "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{INDEX}']"}}},
            {"name": "PET_MASTER_ADDR", "value": "127.0.0.1"},
            {"name": "PET_MASTER_PORT", "value": str(job.port)},
        ]  # fmt: skip
        container = {"name": "node", "image": tr.get("image", ""), "command": list(tr.get("command") or [])}
        container.update(
            args=list(tr.get("args") or []), env=env, resources=dict(tr.get("resourcesPerNode") or {})
        )
        labels = {**patch["metadata"]["labels"], JOBSET_NAME: job.name, INDEX: str(k),
                  "jobset.sigs.k8s.io/replicatedjob-name": "node", "trainer.kubeflow.org/trainjob-ancestor-step": "trainer"}  # fmt: skip
        owner = {"apiVersion": "batch/v1", "kind": "Job", "name": f"{job.name}-node-0", "uid": job.uid, "controller": True}  # fmt: skip
        body = {
            "metadata": {
                "name": f"{job.name}-node-0-{k}-{uuid.uuid4().hex[:5]}",
                "labels": labels,
                "annotations": {**patch["metadata"].get("annotations", {}), INDEX: str(k)},
                "ownerReferences": [owner],
            },
            "spec": {"restartPolicy": "OnFailure", "hostname": f"{job.name}-node-0-{k}", "subdomain": job.name,
                     "containers": _merge_containers(container, patch["containers"]), **patch["spec"]},
        }  # fmt: skip
        code, out = self.ex.workers.create(self.ex.cluster.namespace, body)
        if code == 403:  # Pod Security: the Job controller records FailedCreate and tries again later
            job.refused.append(out["message"])
            return
        if code != 201:
            raise RuntimeError(f"twin: node pod {k} of TrainJob {job.name} refused: {out}")
        job.pods[k] = body["metadata"]["name"]
