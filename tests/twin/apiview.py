"""What the API stand-in (kubeapi.py) sees of a twin run: its task pods, the pods its steps created
(workers.py), the TrainJobs they created (trainjobs.py), and its Workflow object; mixed into
engine.TwinExecution.

Design choices:
- Task pods are served with the fields a step reads of its own pod: labels, annotations, the Workflow as
  controller ownerReference, nodeName, serviceAccountName, phase/reason/message, conditions, and a
  deletionTimestamp while a graceful delete is under way.
- The Workflow is served with what a step may read of it to learn that the run is being stopped:
  `spec.activeDeadlineSeconds` (0 after KFP's terminate) and `status.startedAt`.

Rules and their sources:
- Argo workflow/controller/workflowpod.go createWorkflowPod: every pod of a workflow has the Workflow as its
  controller ownerReference (metav1.NewControllerRef: controller and blockOwnerDeletion true).
- KFP 2.17 backend/src/common/util/workflow.go IsTerminating: TerminateRun sets activeDeadlineSeconds 0.
- The DisruptionTarget condition of a pod the cluster is taking away, and deletionTimestamp during a
  graceful delete: workers.py (the same rules apply to task pods).
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

from tests.twin.dag import TaskNode
from tests.twin.ir import workflow_deadline_s
from tests.twin.records import AttemptRecord
from tests.twin.workers import DISRUPTION_REASONS


def _rfc3339(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class ApiViewMixin:
    # --- the API stand-in's view (kubeapi.PodTable) ---
    def list_pods(self, namespace: str) -> list[dict[str, Any]]:
        if namespace != self.cluster.namespace:
            return []
        with self.lock:
            tasks = [
                self._pod_json(n, a)
                for pod, (n, a) in self.pods.items()
                if pod not in self.deleted and (a.phase != "Error" or a.started_real is not None)
            ]
            return tasks + self.workers.list()

    def create_pod(self, namespace: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        if namespace != self.cluster.namespace:
            return 403, {"reason": "Forbidden", "message": f"the twin's steps may create pods in {self.cluster.namespace} only"}  # fmt: skip
        with self.lock:
            return self.workers.create(namespace, body)

    def list_trainjobs(self, namespace: str) -> list[dict[str, Any]]:
        with self.lock:
            return self.trainjobs.list() if namespace == self.cluster.namespace else []

    def create_trainjob(self, namespace: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        if namespace != self.cluster.namespace:
            return 403, {"reason": "Forbidden", "message": f"the twin's steps may create TrainJobs in {self.cluster.namespace} only"}  # fmt: skip
        with self.lock:
            return self.trainjobs.create(namespace, body)

    def delete_trainjob(self, namespace: str, name: str, propagation: str | None) -> dict[str, Any] | None:
        with self.lock:
            return self.trainjobs.delete(name, propagation) if namespace == self.cluster.namespace else None

    def get_workflow(self, namespace: str, name: str) -> dict[str, Any] | None:
        if namespace != self.cluster.namespace or name != self.workflow:
            return None
        spec: dict[str, Any] = {}
        deadline = workflow_deadline_s(self.ir)
        if self.record.terminated:
            spec["activeDeadlineSeconds"] = 0
        elif deadline is not None:
            spec["activeDeadlineSeconds"] = int(deadline)
        return {
            "apiVersion": "argoproj.io/v1alpha1",
            "kind": "Workflow",
            "metadata": {"name": self.workflow, "namespace": namespace, "uid": self.workflow_uid},
            "spec": spec,
            "status": {"phase": "Running", "startedAt": _rfc3339(self.t0_wall)},
        }

    def delete_pod(self, namespace: str, name: str, grace_period_s: float | None) -> dict[str, Any] | None:
        with self.lock:
            if namespace != self.cluster.namespace:
                return None
            if name in self.workers.pods:
                return self.workers.delete(name, grace_period_s)
            if name not in self.pods or name in self.deleted:
                return None
            node, a = self.pods[name]
            body = self._pod_json(node, a)
            self.deleted.add(name)
            proc = node.state.get("proc") if node.record.attempts[-1] is a else None
            if a.done or proc is None:
                return body  # a completed pod is just removed; Argo keeps the node's phase
            if grace_period_s:
                proc.terminate(grace_period_s / self.time_scale)
                self.dying.append(proc)
            else:
                proc.kill()
            a.exit_code = proc.returncode
            self._end(
                node,
                a,
                "Error",
                "pod deleted",
                f"pod deleted through the API (grace period {grace_period_s or 0:g}s)",
            )
            return {**body, "metadata": {**body["metadata"], "deletionTimestamp": _rfc3339(time.time())}}

    def _pod_json(self, node: TaskNode, a: AttemptRecord) -> dict[str, Any]:
        phase = a.phase if a.phase != "Error" else "Failed"
        status: dict[str, Any] = {
            "phase": phase,
            **({"reason": a.status_reason} if a.status_reason else {}),
            **({"message": a.status_message} if a.status_message else {}),
        }
        meta: dict[str, Any] = {
            "name": a.pod_name,
            "namespace": self.cluster.namespace,
            "uid": a.uid,
            "labels": dict(a.labels),
            "annotations": {**node.state["pod"].annotations, "workflows.argoproj.io/node-name": a.node_name},
            "creationTimestamp": _rfc3339(self.t0_wall + a.created_real),
            "ownerReferences": [
                {"apiVersion": "argoproj.io/v1alpha1", "kind": "Workflow", "name": self.workflow,
                 "uid": self.workflow_uid, "controller": True, "blockOwnerDeletion": True}
            ],
        }  # fmt: skip
        failure = node.state.get("failure") if node.record.attempts[-1] is a and not a.done else None
        if failure is not None and failure.name in DISRUPTION_REASONS:
            reason = DISRUPTION_REASONS[failure.name]
            status["conditions"] = [{"type": "DisruptionTarget", "status": "True", "reason": reason}]
            if failure.name == "drain":
                meta["deletionTimestamp"] = _rfc3339(time.time())
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": meta,
            "spec": {
                "containers": [{"name": "main", "image": node.state["pod"].image}],
                "nodeName": a.node,
                "serviceAccountName": self.cluster.service_account,
                "activeDeadlineSeconds": node.state["pod"].active_deadline_seconds,
            },
            "status": status,
        }
