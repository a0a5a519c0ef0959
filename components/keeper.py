"""The keeper's decisions, as pure functions of pod JSON: worker names and manifests, how a worker ended, which
worker a (retried) keeper adopts. `keeper_loop` acts on them through the Kubernetes API.

A keeper is the KFP task of a learner or the syncer: a small CPU pod that creates the role's *worker* pod
(the GPU learner, the syncer) through the Kubernetes API, watches it, and starts a new incarnation when the
cluster takes it away. Stock KFP 2.17 (`retryPolicy: OnError`) retries only a pod whose object disappears;
every other infrastructure failure ends the pod `Failed` and the task with it (docs/cluster.md, "Retries").
The keeper moves those failures to a pod whose status it reads itself. Workers have deterministic names and
are owned by the keeper pod and the Workflow, so a retried keeper adopts its worker (`pick`) and a deleted run
takes it away. `classify` tells infrastructure (a new incarnation) from a crash (counted against
`crash_restarts`) and from a usage error (exit 2, never restarted).

Design notes (names, owners, labels, each failure reason and its source): docs/internals.md, "Keepers".
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

from ddiloco.components.podsettings import QUEUE_LABEL, PodSettings, container_security_context

ROLE_LABEL = "ddiloco.io/role"  # ddiloco.chaos.k8s.ROLE_LABEL (kept in sync by tests/unit/test_keeper.py)
WORKFLOW_LABEL = "workflows.argoproj.io/workflow"
KEEPER_LABEL = "ddiloco.io/keeper"
RUN_LABEL = "ddiloco.io/run"
LEARNER_LABEL = "ddiloco.io/learner-id"
INCARNATION_LABEL = "ddiloco.io/incarnation"
PART_OF = {"app.kubernetes.io/part-of": "ddiloco"}

RUNNING, SUCCEEDED, INFRA, CRASH, USAGE = "running", "succeeded", "infrastructure", "crash", "usage"
INFRA_REASONS = ("Evicted", "Terminated", "Shutdown", "UnexpectedAdmissionError", "NodeAffinity", "NodeLost")
USAGE_EXIT = 2
"""`ddiloco` exits 2 for a mistake its one-line message explains: restarting cannot help."""


@dataclass(frozen=True)
class Ending:
    state: str
    """RUNNING, SUCCEEDED, INFRA, CRASH or USAGE."""
    why: str


@dataclass(frozen=True)
class Slot:
    """What one keeper keeps: a role (learner / syncer), its learner id, in one run."""

    role: str
    run_id: str
    learner_id: int | None = None

    @property
    def run_hash(self) -> str:
        return hashlib.sha256(self.run_id.encode()).hexdigest()[:10]

    def name(self, incarnation: int) -> str:
        lid = "" if self.learner_id is None else f"-{self.learner_id}"
        return f"ddiloco-{self.role}{lid}-{self.run_hash}-{incarnation}"

    def selector(self) -> str:
        sel = f"{ROLE_LABEL}={self.role},{RUN_LABEL}={self.run_hash}"
        return sel if self.learner_id is None else f"{sel},{LEARNER_LABEL}={self.learner_id}"

    def labels(self, incarnation: int, workflow: str) -> dict[str, str]:
        out = {
            **PART_OF,
            ROLE_LABEL: self.role,
            RUN_LABEL: self.run_hash,
            INCARNATION_LABEL: str(incarnation),
        }
        if self.learner_id is not None:
            out[LEARNER_LABEL] = str(self.learner_id)
        if workflow:
            out[WORKFLOW_LABEL] = workflow
        return out


@dataclass(frozen=True)
class WorkerSpec:
    """The worker's container: what the KFP task pod has today, for the role's own command."""

    image: str
    command: list[str]
    env: list[dict[str, Any]] = field(default_factory=list)
    """Kubernetes EnvVar objects (value, or valueFrom secretKeyRef / fieldRef)."""
    requests: dict[str, str] = field(default_factory=dict)
    limits: dict[str, str] = field(default_factory=dict)
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict[str, Any]] = field(default_factory=list)
    service_account: str = ""
    shm: str = ""
    """Size limit of a memory-backed /dev/shm (`shm_volume`); empty: the container runtime's 64 MiB."""
    settings: PodSettings = field(default_factory=PodSettings)
    """The run's Kueue queue, priority class, affinity, pull secrets, extra labels and annotations."""


def owner_references(keeper_pod: dict[str, Any]) -> list[dict[str, Any]]:
    """The keeper pod (controller) and the keeper's own controller (the Workflow), see the module docstring."""
    meta = keeper_pod["metadata"]
    refs = [{"apiVersion": "v1", "kind": "Pod", "name": meta["name"], "uid": meta["uid"], "controller": True}]
    for ref in meta.get("ownerReferences") or []:
        if ref.get("controller"):
            refs.append({k: ref[k] for k in ("apiVersion", "kind", "name", "uid")} | {"controller": False})
    return refs


def resources_of(spec: WorkerSpec) -> dict[str, Any]:
    """The worker's requests and limits, those that are set (a container's `resources`)."""
    return {k: dict(v) for k, v in (("requests", spec.requests), ("limits", spec.limits)) if v}


def placement(spec: WorkerSpec, keeper_pod: dict[str, Any]) -> dict[str, Any]:
    """Where a worker's pods go and as whom: nodeSelector, tolerations and the service account (the
    worker's, else the run's `pod_settings.service_account`, else the keeper pod's), those that are set."""
    out: dict[str, Any] = {}
    if spec.node_selector:
        out["nodeSelector"] = dict(spec.node_selector)
    if spec.tolerations:
        out["tolerations"] = [dict(t) for t in spec.tolerations]
    sa = spec.service_account or spec.settings.service_account
    sa = sa or (keeper_pod.get("spec") or {}).get("serviceAccountName", "")
    if sa:
        out["serviceAccountName"] = sa
    return out


SHM_VOLUME, SHM_PATH, SHM_MEDIUM = "dshm", "/dev/shm", "Memory"


def shm_volume(spec: WorkerSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(pod volumes, container volumeMounts) of the worker's /dev/shm: a memory-backed emptyDir of `spec.shm`
    (none when empty). NCCL keeps its proxy buffers (~33 MB per communicator) and, between GPUs without
    peer-to-peer access, its intra-node transport in /dev/shm; a pod gets 64 MiB there by default, which
    multi-GPU ranks outgrow (https://github.com/kubeflow/trainer/blob/master/docs/user-guides/megatron.md,
    "Increasing /dev/shm for NCCL"). Written pages count against the pod's memory; unwritten ones cost
    nothing."""
    if not spec.shm:
        return [], []
    volume = {"name": SHM_VOLUME, "emptyDir": {"medium": SHM_MEDIUM, "sizeLimit": spec.shm}}
    return [volume], [{"name": SHM_VOLUME, "mountPath": SHM_PATH}]


def worker_manifest(
    slot: Slot, incarnation: int, spec: WorkerSpec, keeper_pod: dict[str, Any]
) -> dict[str, Any]:
    """The worker pod: restartPolicy Never, the keeper's namespace, owners, the downward-API pod name, the
    Istio opt-out, a `restricted` securityContext and the run's scheduling settings (`podsettings`)."""
    meta = keeper_pod["metadata"]
    workflow = (meta.get("labels") or {}).get(WORKFLOW_LABEL, "")
    container: dict[str, Any] = {"name": "main", "image": spec.image, "command": list(spec.command)}
    container["securityContext"] = container_security_context()
    if spec.env:
        container["env"] = [dict(e) for e in spec.env]
    resources = resources_of(spec)
    if resources:
        container["resources"] = resources
    volumes, mounts = shm_volume(spec)
    if mounts:
        container["volumeMounts"] = mounts
    pod_spec = {"restartPolicy": "Never", "containers": [container], **placement(spec, keeper_pod)}
    pod_spec.update(spec.settings.pod_spec(priority=True))
    if volumes:
        pod_spec["volumes"] = volumes
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": slot.name(incarnation),
            "namespace": meta["namespace"],
            "labels": spec.settings.pod_labels(slot.labels(incarnation, workflow), queue=True),
            "annotations": spec.settings.pod_annotations({"ddiloco.io/keeper-pod": meta["name"]}),
            "ownerReferences": owner_references(keeper_pod),
        },
        "spec": pod_spec,
    }


def _main_terminated(pod: dict[str, Any]) -> dict[str, Any] | None:
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        if cs.get("name") == "main" or len(pod["status"]["containerStatuses"]) == 1:
            return (cs.get("state") or {}).get("terminated") or (cs.get("lastState") or {}).get("terminated")
    return None


def disruption(pod: dict[str, Any]) -> str | None:
    """The DisruptionTarget condition's reason (or "deleted" for a deletionTimestamp), None if neither."""
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "DisruptionTarget" and cond.get("status", "True") == "True":
            return f"DisruptionTarget {cond.get('reason', '')}".strip()
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return "deleted (deletionTimestamp set)"
    return None


def waiting(pod: dict[str, Any]) -> str:
    """Why a Pending pod waits, as far as its object says: scheduling gates (Kueue's
    `kueue.x-k8s.io/admission` until its queue admits it: kueue pkg/controller/jobs/pod SchedulingGateName),
    the scheduler's PodScheduled condition, or the status message; "" when it says nothing."""
    gates = [g.get("name", "") for g in (pod.get("spec") or {}).get("schedulingGates") or []]
    if gates:
        queue = ((pod.get("metadata") or {}).get("labels") or {}).get(QUEUE_LABEL, "")
        kueue = f", waiting for Kueue to admit it (queue {queue!r})" if queue else ""
        return f"held by scheduling gates {gates}{kueue}"
    status = pod.get("status") or {}
    for cond in status.get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
            return f"{cond.get('reason', '')}: {cond.get('message', '')}".strip(": ")
    return str(status.get("message") or "")


def classify(pod: dict[str, Any] | None) -> Ending:
    """How a worker pod stands or ended (module docstring). None = the pod object is gone."""
    if pod is None:
        return Ending(INFRA, "the pod object is gone (deleted, drained, garbage-collected or its node lost)")
    status = pod.get("status") or {}
    phase, reason, message = (
        status.get("phase", "Pending"),
        status.get("reason", ""),
        status.get("message", ""),
    )
    if phase == "Succeeded":
        return Ending(SUCCEEDED, "succeeded")
    disrupted = disruption(pod)
    if phase != "Failed":
        held = waiting(pod) if phase == "Pending" else ""
        extra = f", being taken away: {disrupted}" if disrupted else (f": {held}" if held else "")
        return Ending(RUNNING, f"{phase}{extra}")
    term = _main_terminated(pod)
    code = term.get("exitCode") if term else None
    detail = f"{reason}: {message}".strip(": ") if reason or message else ""
    if disrupted:
        return Ending(INFRA, f"{disrupted}" + (f" ({detail})" if detail else ""))
    if reason in INFRA_REASONS or reason.startswith("OutOf"):
        return Ending(INFRA, detail)
    if term and term.get("reason") == "OOMKilled":
        return Ending(INFRA, f"OOMKilled (exit code {code})")
    if term is None:
        return Ending(INFRA, f"failed without running a container{f' ({detail})' if detail else ''}")
    if code == USAGE_EXIT:
        return Ending(USAGE, f"exit code {code}: a usage error (its message is in the worker's log)")
    return Ending(CRASH, f"exit code {code}" + (f" ({term['reason']})" if term.get("reason") else ""))


def live(pod: dict[str, Any]) -> bool:
    """Pending or Running and not being deleted."""
    phase = (pod.get("status") or {}).get("phase", "Pending")
    return phase in ("Pending", "Running", "Unknown") and not (pod.get("metadata") or {}).get(
        "deletionTimestamp"
    )


def incarnation(pod: dict[str, Any]) -> int:
    return int(((pod.get("metadata") or {}).get("labels") or {}).get(INCARNATION_LABEL, "-1"))


@dataclass(frozen=True)
class Pick:
    adopt: dict[str, Any] | None
    """The live worker to adopt (None: start `next_incarnation`)."""
    next_incarnation: int
    crashes: int
    """Earlier incarnations that crashed (counted against crash_restarts)."""
    infra: int
    """Earlier incarnations the infrastructure took away (of those whose pod is still there)."""
    done: dict[str, Any] | None = None
    """The newest worker, if it Succeeded: the slot's work is done."""
    ending: dict[str, Any] | None = None
    """The newest worker, if it ended with a usage error (the keeper must fail, not restart it)."""
    terminating: list[str] = field(default_factory=list)
    """Workers still being deleted: wait for them to go before starting another."""


def pick(pods: list[dict[str, Any]]) -> Pick:
    """What a keeper that finds these workers of its slot does (module docstring, "Adoption")."""
    ordered = sorted(pods, key=incarnation)
    endings = [(p, classify(p)) for p in ordered]
    crashes = sum(e.state == CRASH for _, e in endings)
    infra = sum(e.state == INFRA for p, e in endings if not live(p) and e.state != RUNNING)
    nxt = incarnation(ordered[-1]) + 1 if ordered else 0
    terminating = [
        p["metadata"]["name"]
        for p, e in endings
        if e.state == RUNNING and (p.get("metadata") or {}).get("deletionTimestamp")
    ]
    if not ordered:
        return Pick(None, 0, 0, 0)
    newest, ending = endings[-1]
    if live(newest):
        return Pick(newest, nxt, crashes, infra, terminating=terminating)
    if ending.state == SUCCEEDED:
        return Pick(None, nxt, crashes, infra, done=newest)
    if ending.state == USAGE:
        return Pick(None, nxt, crashes, infra, ending=newest)
    return Pick(None, nxt, crashes, infra, terminating=terminating)


def workflow_stopped(workflow: dict[str, Any] | None, now_s: float) -> bool:
    """Whether Argo is stopping the run: KFP TerminateRun sets `spec.activeDeadlineSeconds: 0` (KFP 2.17
    backend/src/common/util/workflow.go IsTerminating), `argo stop/terminate` set `spec.shutdown`, and a run past its
    activeDeadlineSeconds is stopped by Argo (workflow/controller/operator.go, workflowDeadline)."""
    if not workflow:
        return False
    spec, status = workflow.get("spec") or {}, workflow.get("status") or {}
    if spec.get("shutdown"):
        return True
    ads = spec.get("activeDeadlineSeconds")
    if ads is None:
        return False
    if int(ads) == 0:
        return True
    started = status.get("startedAt")
    if not started:
        return False
    from datetime import datetime

    t0 = datetime.fromisoformat(str(started).replace("Z", "+00:00")).timestamp()
    return now_s >= t0 + int(ads)
