"""Pods a step creates through the API stand-in (POST /api/v1/namespaces/{ns}/pods): the keeper's workers.

Design choices:
- A created pod is a real process through the twin's pod machinery (pods.PodProcess), scheduled against the
  twin's nodes (cluster.schedule: a GPU worker needs a GPU node and a free GPU), with its env built as for
  a task pod (cluster.container_env: secretKeyRef, downward API), Pending until both succeed.
- It is no Argo pod: no emissary, no launcher, no retry; its status is what the kubelet writes, and the twin
  serves it in the JSON shape of the API (phase, reason, message, conditions, containerStatuses[].state.
  terminated.{exitCode, reason}, metadata.deletionTimestamp).
- Failure kinds (failures.KINDS) are injected as into a task pod (`TwinExecution.inject`), with the status a
  real pod would get; `admission` force-deletes the pod and makes its node reject the next pod that asks for
  the same extended resource there (kubernetes#130145).
- Time: grace periods are cluster seconds, divided by the twin's time_scale like every other duration.

- Admission at create (admission.py, kueue.py): Istio's injector and Kueue's pod webhook mutate the pod,
  then Pod Security admission may refuse it (403 Forbidden, its message in `refused`); a gated pod stays
  Pending until `_admit` ungates it; a pod with an injected regular `istio-proxy` stays Running after its
  main container ended.

Rules and their sources (Kubernetes):
- Create: a pod whose name is taken is refused 409 AlreadyExists (apiserver registry/rest/create.go); the
  namespace of the body must match the URL's (400 BadRequest); a volumeMount must name a volume of the pod
  (422 Invalid: pkg/apis/core/validation/validation.go validateVolumeMounts, NotFound).
- restartPolicy Never: a container that exits ends the pod: Succeeded for exit 0, else Failed
  (pkg/kubelet/kubelet_pods.go getPhase); the container's terminated state holds exitCode and reason
  "Completed" / "Error" / "OOMKilled" (the runtime's reason).
- Delete with gracePeriodSeconds 0: the object is removed at once and the kubelet kills the containers;
  otherwise deletionTimestamp is set, the kubelet sends SIGTERM, SIGKILL after the grace period (default
  terminationGracePeriodSeconds 30), and the object is removed once the containers are gone
  (pkg/registry/core/pod/strategy.go CheckGracefulDelete, kubelet pod_workers.go).
- Disruptions set the DisruptionTarget condition before the kill (k8s.io/api core/v1 types.go reasons:
  TerminationByKubelet for node-pressure eviction and graceful node shutdown, EvictionByEvictionAPI for a
  drain), and the pod's reason and message as failures.py says.
- Garbage collection: a pod whose ownerReferences all name objects that are gone is deleted (background
  propagation, the pod's default grace period); an owner still present keeps it (pkg/controller/
  garbagecollector/garbagecollector.go attemptToDeleteItem, "solid" owners). Owners the twin knows: the
  run's pods (gone once deleted), the run's Workflow (present for the whole run) and its TrainJobs
  (trainjobs.py: their node pods' stand-in Job has the TrainJob's uid).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tests.twin import kueue
from tests.twin.admission import PROXY, inject, pod_security
from tests.twin.cluster import PodPending, container_env, expand, schedule
from tests.twin.failures import FailureKind, failure_kind, signal_exit_code
from tests.twin.identity import identity_env
from tests.twin.platform import EnvVar, PodSpec, quantity
from tests.twin.pods import SITE_DIR, PodProcess, base_env

DEFAULT_GRACE_S = 30.0
DISRUPTION_REASONS = {"preempt": "TerminationByKubelet", "evict": "TerminationByKubelet", "drain": "EvictionByEvictionAPI"}  # fmt: skip


def _rfc3339(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _env(container: dict[str, Any]) -> list[EnvVar]:
    out = []
    for e in container.get("env") or []:
        src = e.get("valueFrom") or {}
        if "secretKeyRef" in src:
            ref = src["secretKeyRef"]
            out.append(EnvVar(e["name"], secret=(ref["name"], ref["key"], ref.get("optional"))))
        elif "fieldRef" in src:
            out.append(EnvVar(e["name"], field_path=src["fieldRef"]["fieldPath"]))
        else:
            out.append(EnvVar(e["name"], value=e.get("value", "")))
    return out


def pod_spec(body: dict[str, Any]) -> PodSpec:
    """What the twin acts on of a created pod (one container, besides an injected `istio-proxy`)."""
    spec = body.get("spec") or {}
    containers = [c for c in spec.get("containers") or [] if c.get("name") != PROXY]
    if len(containers) != 1 or [c for c in spec.get("initContainers") or [] if c.get("name") != PROXY]:
        raise ValueError("the twin runs created pods with exactly one container")
    c, res = containers[0], containers[0].get("resources") or {}
    volumes, mounts = list(spec.get("volumes") or []), list(c.get("volumeMounts") or [])
    for i, m in enumerate(mounts):  # validation.go validateVolumeMounts
        if m.get("name") not in {v.get("name") for v in volumes}:
            raise ValueError(f'spec.containers[0].volumeMounts[{i}].name: Not found: "{m.get("name")}"')
    for v in volumes:
        if (v.get("emptyDir") or {}).get("sizeLimit"):
            quantity(v["emptyDir"]["sizeLimit"])
    return PodSpec(
        command=[*(c.get("command") or []), *(c.get("args") or [])],
        image=c.get("image", ""),
        env=_env(c),
        node_selector=dict(spec.get("nodeSelector") or {}),
        tolerations=list(spec.get("tolerations") or []),
        requests=dict(res.get("requests") or {}),
        limits=dict(res.get("limits") or {}),
        labels=dict((body.get("metadata") or {}).get("labels") or {}),
        volumes=volumes,
        mounts=mounts,
    )


@dataclass
class Worker:
    body: dict[str, Any]
    spec: PodSpec
    uid: str
    created: float
    phase: str = "Pending"
    node: str | None = None
    proc: PodProcess | None = None
    reason: str = ""
    message: str = ""
    conditions: list[dict[str, Any]] = field(default_factory=list)
    terminated: dict[str, Any] | None = None
    deleting: float | None = None
    failure: FailureKind | None = None
    started: float | None = None
    proxy: str = ""
    """"regular" or "native": an injected istio-proxy (admission.py), which never exits."""

    @property
    def name(self) -> str:
        return self.body["metadata"]["name"]

    @property
    def gated(self) -> bool:
        return bool((self.body.get("spec") or {}).get("schedulingGates"))

    def json(self) -> dict[str, Any]:
        meta = {**self.body["metadata"], "uid": self.uid, "creationTimestamp": _rfc3339(self.created)}
        if self.deleting is not None:
            meta["deletionTimestamp"] = _rfc3339(self.deleting)
        status: dict[str, Any] = {"phase": self.phase}
        for key, value in (("reason", self.reason), ("message", self.message)):
            if value:
                status[key] = value
        if self.conditions:
            status["conditions"] = list(self.conditions)
        cs = {"name": "main", "image": self.spec.image, "imageID": "", "restartCount": 0, "ready": False}
        if (
            self.terminated is not None
        ):  # V1ContainerStatus requires image, imageID, name, ready, restartCount
            status["containerStatuses"] = [{**cs, "state": {"terminated": dict(self.terminated)}}]
        elif self.proc is not None:
            status["containerStatuses"] = [{**cs, "ready": True, "state": {"running": {}}}]
        if self.proxy == "regular" and self.phase == "Running":  # it outlives the main container
            proxy = {**cs, "name": PROXY, "image": "istio/proxyv2", "ready": True, "state": {"running": {}}}
            status["containerStatuses"] = [*status.get("containerStatuses", []), proxy]
        if self.gated:
            status["conditions"] = [*status.get("conditions", []), {"type": "PodScheduled", "status": "False", "reason": "SchedulingGated", "message": "Scheduling is blocked due to non-empty scheduling gates"}]  # fmt: skip
        return {
            **self.body,
            "metadata": meta,
            "spec": {**self.body["spec"], "nodeName": self.node},
            "status": status,
        }


class WorkerPods:
    """The created pods of one twin run; `ex` is the TwinExecution (clock, cluster, env, locks)."""

    def __init__(self, ex: Any) -> None:
        self.ex = ex
        self.pods: dict[str, Worker] = {}
        self.ended: dict[str, dict[str, Any]] = {}
        """name -> the pod's JSON when it ended (kept for tests after the object is gone)."""
        self.reject_on: dict[str, str] = {}
        """node -> extended resource its device manager refuses once (kubernetes#130145)."""
        self.refused: list[str] = []
        """Pod Security admission's messages, in order (admission.py)."""

    # --- the API ---
    def create(self, namespace: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        meta = body.get("metadata") or {}
        name = meta.get("name", "")
        if meta.get("namespace", namespace) != namespace or not name:
            return 400, {"reason": "BadRequest", "message": "the namespace of the object does not match"}
        if name in self.pods or name in self.ex.pods:
            return 409, {"reason": "AlreadyExists", "message": f'pods "{name}" already exists'}
        cluster = self.ex.cluster
        body = kueue.gate(
            cluster.queues, inject(cluster.namespace_labels, body, cluster.istio_native_sidecars)
        )
        forbidden = pod_security(cluster.namespace_labels, body)  # after the mutating webhooks
        if forbidden:
            self.refused.append(forbidden)
            return 403, {"reason": "Forbidden", "message": forbidden}
        try:
            spec = pod_spec(body)
        except (ValueError, KeyError) as e:
            return 422, {"reason": "Invalid", "message": f'Pod "{name}" is invalid: {e}'}
        body = {**body, "metadata": {**meta, "namespace": namespace}}
        w = Worker(body, spec, str(uuid.uuid4()), time.time())
        if any(c.get("name") == PROXY for c in body["spec"].get("containers") or []):
            w.proxy = "regular"
        elif any(c.get("name") == PROXY for c in body["spec"].get("initContainers") or []):
            w.proxy = "native"
        self.pods[name] = w
        return 201, w.json()

    def list(self) -> list[dict[str, Any]]:
        return [w.json() for w in self.pods.values()]

    def delete(self, name: str, grace_s: float | None) -> dict[str, Any] | None:
        w = self.pods.get(name)
        if w is None:
            return None
        body = w.json()
        grace = DEFAULT_GRACE_S if grace_s is None else grace_s
        if grace <= 0 or w.proc is None or w.proc.returncode is not None:
            if w.proc is not None and w.proc.returncode is None:
                w.proc.kill()
                self.ended.setdefault(name, {**body, "deleted": True})
            del self.pods[name]
            return body
        if w.deleting is None:
            w.deleting = time.time()
            w.proc.terminate(grace / self.ex.time_scale)
        return w.json()

    def inject(self, name: str, kind: str) -> None:
        k, w = failure_kind(kind), self.pods[name]
        if w.proc is None or w.proc.returncode is not None or w.deleting is not None:
            raise ValueError(f"pod {name!r} is not a running pod")
        if k.name == "admission":
            for res in w.spec.limits:
                if res not in ("cpu", "memory") and w.node:
                    self.reject_on[w.node] = res
            self.delete(name, 0)
            return
        w.failure = k
        if k.name in DISRUPTION_REASONS:
            w.conditions.append(
                {"type": "DisruptionTarget", "status": "True", "reason": DISRUPTION_REASONS[k.name]}
            )
        if k.name == "drain":
            w.deleting = time.time()
        if k.graceful:
            w.proc.terminate(self.ex.grace_real)
        else:
            w.proc.kill()
            self._ended(w, w.proc.returncode)

    # --- the kubelet and the garbage collector, once per tick ---
    def poll(self) -> None:
        self._admit()
        for w in list(self.pods.values()):
            if w.phase == "Pending" and not w.gated:
                self._start(w)
            elif w.phase == "Running" and w.terminated is None and w.proc is not None and w.proc.poll() is not None:  # fmt: skip
                self._ended(w, w.proc.returncode)
        self._collect()

    def _admit(self) -> None:
        """Kueue (kueue.py): ungate the queued pods that fit their queue's quota, oldest first."""
        queues = self.ex.cluster.queues
        if queues is None:
            return
        used: dict[str, dict[str, float]] = {}
        for w in self.pods.values():
            if kueue.queue_of(w.body) and not w.gated and w.phase in ("Pending", "Running"):
                kueue.add(used.setdefault(kueue.queue_of(w.body), {}), kueue.pod_usage(w.body["spec"]))
        for w in sorted(self.pods.values(), key=lambda w: w.created):
            queue = kueue.queue_of(w.body)
            want = kueue.pod_usage(w.body["spec"])
            if w.gated and kueue.fits(queues.get(queue), used.get(queue, {}), want):
                gates = [g for g in w.body["spec"]["schedulingGates"] if g.get("name") != kueue.GATE]
                w.body = {**w.body, "spec": {**w.body["spec"], "schedulingGates": gates}}
                kueue.add(used.setdefault(queue, {}), want)

    def gpus(self) -> dict[str, dict[str, float]]:
        used: dict[str, dict[str, float]] = {}
        for w in self.pods.values():
            if w.node and w.phase == "Running":
                for res, q in w.spec.limits.items():
                    if res not in ("cpu", "memory"):
                        used.setdefault(w.node, {})[res] = used.get(w.node, {}).get(res, 0.0) + quantity(q)
        return used

    def procs(self) -> list[PodProcess]:
        return [w.proc for w in self.pods.values() if w.proc is not None]

    def _start(self, w: Worker) -> None:
        ex, meta = self.ex, w.body["metadata"]
        used = ex._gpus_in_use()
        info = {"name": w.name, "namespace": meta["namespace"], "uid": w.uid, "labels": meta.get("labels") or {},
                "annotations": meta.get("annotations") or {},
                "service_account": w.body["spec"].get("serviceAccountName", ex.cluster.service_account)}  # fmt: skip
        try:
            info["node"] = schedule(w.spec, ex.cluster.nodes, used).name
            pod_env = identity_env(ex.cluster.web_identities, info["service_account"])
            pod_env.update(container_env(w.spec.env, info, ex.cluster.secrets))
        except PodPending as p:
            w.reason, w.message = "", p.message  # stays Pending (Unschedulable / CreateContainerConfigError)
            return
        w.node, w.reason, w.message = info["node"], "", ""
        rejected = self.reject_on.get(w.node)
        if rejected and rejected in w.spec.limits:
            del self.reject_on[w.node]
            w.phase, w.reason = "Failed", "UnexpectedAdmissionError"
            w.message = failure_kind("admission").pod_message
            self.ended[w.name] = w.json()
            return
        pod_dir = ex.work_dir / "pods" / w.name
        (pod_dir / "tmp").mkdir(parents=True, exist_ok=True)
        env = {
            **base_env(ex.python_bin), **ex.extra_env, **pod_env, "HOSTNAME": w.name[:63],
            "TWIN_POD_HOSTNAME": w.name[:63], "TMPDIR": str(pod_dir / "tmp"),
            "TWIN_POD_UID": w.uid, "TWIN_RUN_ID": ex.record.run_id,
        }  # fmt: skip
        if env["PYTHONPATH"] != str(SITE_DIR):
            env["PYTHONPATH"] = f"{SITE_DIR}:{env['PYTHONPATH']}"
        argv = [expand(x, env) for x in w.spec.command]
        w.proc, w.phase, w.started = (
            PodProcess(argv, env, pod_dir, self.log(w.name)),
            "Running",
            time.monotonic(),
        )

    def log(self, name: str) -> Path:
        return self.ex.work_dir / "pods" / name / "pod.log"

    def _ended(self, w: Worker, rc: int | None) -> None:
        k = w.failure
        code = 137 if k is not None and k.container_reason == "OOMKilled" else signal_exit_code(rc)
        if k is not None:
            w.reason, w.message = k.pod_reason, k.pod_message
            reason = k.container_reason or "Error"
        else:
            reason = "Completed" if code == 0 else "Error"
        w.terminated = {"exitCode": code, "reason": reason}
        if w.proxy == "regular" and k is None and w.deleting is None:
            return  # the main container ended, istio-proxy runs on: the pod stays Running (admission.py)
        w.phase = "Succeeded" if code == 0 and k is None else "Failed"
        self.ended[w.name] = w.json()
        if w.deleting is not None:
            del self.pods[w.name]  # the kubelet confirms the graceful delete once the containers are gone

    def _collect(self) -> None:
        """The garbage collector (module docstring)."""
        present = {w.uid for w in self.pods.values()} | {self.ex.workflow_uid} | self.ex.trainjobs.uids()
        present |= {n.state.get("uid") for p, (n, _) in self.ex.pods.items() if p not in self.ex.deleted}
        for w in list(self.pods.values()):
            owners = [o["uid"] for o in w.body["metadata"].get("ownerReferences") or []]
            if owners and not any(uid in present for uid in owners) and w.deleting is None:
                self.delete(w.name, None)
