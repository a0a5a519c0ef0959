"""Kueue admission of the workloads a step creates through the API stand-in: a stand-in for Kueue's plain-pod and
TrainJob integrations and one ClusterQueue per LocalQueue, as far as quota decides admission. Nothing else of
Kueue (no flavors, no cohorts or borrowing, no preemption, no fair sharing, no pod groups).

Design choices:
- `Cluster.queues` (LocalQueue name -> nominal quota, resource -> quantity) is the whole configuration;
  None means Kueue is not installed and the queue label does nothing. A test may change a queue's quota
  while the run goes (the platform team raising it); admission follows on the twin's next tick.
- A workload's usage is its pod's requests (a limit stands for a missing request, as for extended resources)
  or, for a TrainJob, numNodes x resourcesPerNode; it holds its quota from admission until it ends or goes.

Rules and their sources (kubernetes-sigs/kueue; read from the names below, not run):
- Plain pods (pkg/controller/jobs/pod pod_webhook.go Default): a pod with the label
  `kueue.x-k8s.io/queue-name` gets the scheduling gate `kueue.x-k8s.io/admission` (constants
  SchedulingGateName) at creation; the scheduler leaves it Pending (condition PodScheduled False, reason
  SchedulingGated); on admission the gate is removed (pod_controller.go Run -> ungate).
- Jobs (pkg/controller/jobframework reconciler.go, the TrainJob integration among them): a job with the
  queue label is created suspended (`spec.suspend: true`, the webhook's Default) and unsuspended on
  admission; the Trainer does not create its JobSet while suspended (condition Suspended, reason Suspended:
  trainjob_types.go TrainJobSuspended).
- Admission (pkg/scheduler scheduler.go, the ClusterQueue's nominal quota): a workload is admitted when its
  queue exists, covers every resource it requests, and its usage fits what the admitted workloads leave of
  the quota; otherwise it waits (Pending in the queue) and is never admitted while it does not fit.
"""

from __future__ import annotations

from typing import Any

from tests.twin.platform import quantity

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
GATE = "kueue.x-k8s.io/admission"


def queue_of(body: dict[str, Any]) -> str:
    return ((body.get("metadata") or {}).get("labels") or {}).get(QUEUE_LABEL, "")


def gate(queues: dict[str, dict[str, str]] | None, body: dict[str, Any]) -> dict[str, Any]:
    """The pod webhook: a queued pod gets the admission gate (a copy; the body otherwise unchanged)."""
    if queues is None or not queue_of(body):
        return body
    spec = dict(body.get("spec") or {})
    spec["schedulingGates"] = [*(spec.get("schedulingGates") or []), {"name": GATE}]
    return {**body, "spec": spec}


def suspend(queues: dict[str, dict[str, str]] | None, body: dict[str, Any]) -> dict[str, Any]:
    """The job webhook: a queued TrainJob is created suspended."""
    if queues is None or not queue_of(body):
        return body
    return {**body, "spec": {**(body.get("spec") or {}), "suspend": True}}


def pod_usage(spec: dict[str, Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    for c in spec.get("containers") or []:
        res = c.get("resources") or {}
        for name in {*(res.get("requests") or {}), *(res.get("limits") or {})}:
            q = (res.get("requests") or {}).get(name) or (res.get("limits") or {}).get(name)
            out[name] = out.get(name, 0.0) + quantity(q)
    return out


def trainjob_usage(spec: dict[str, Any]) -> dict[str, float]:
    trainer = spec.get("trainer") or {}
    per_node = pod_usage({"containers": [{"resources": trainer.get("resourcesPerNode") or {}}]})
    return {k: v * int(trainer.get("numNodes", 1)) for k, v in per_node.items()}


def fits(quota: dict[str, str] | None, used: dict[str, float], want: dict[str, float]) -> bool:
    """The queue exists, covers every requested resource, and has room for `want` beside `used`."""
    if quota is None:
        return False
    return all(
        name in quota and used.get(name, 0.0) + q <= quantity(quota[name]) + 1e-9 for name, q in want.items()
    )


def add(used: dict[str, float], want: dict[str, float]) -> None:
    for k, v in want.items():
        used[k] = used.get(k, 0.0) + v
