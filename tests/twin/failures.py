"""How a pod ends when the cluster takes it away, and what Argo v4.0.5 makes of it: the failure kinds a test
injects into a running pod with `TwinExecution.inject(pod, kind)`.

Design choices:
- One `FailureKind` per way a real cluster ends a pod that ddiloco must survive: how the kubelet stops the
  main container (SIGTERM then SIGKILL after the grace period, or SIGKILL at once), the pod's
  `status.phase/reason/message`, the main container's terminated state, whether the pod object stays (a
  test listing pods through the API stand-in sees it `Failed`), and the node phase and message Argo
  derives from that pod. The twin's controller records exactly that node phase and message, so the retry
  decision (argo.py retry_decision) sees what a real controller sees.
- `admission` is the kubernetes#130145 sequence: a GPU pod is force-deleted (Argo: Error "pod deleted",
  retried on stock KFP 2.17), and the kubelet, whose device manager still counts the GPU as taken, rejects
  the retry's pod at admission: that pod never runs a container.
- `drain` is what Argo sees when it observes the pod's terminal phase before the pod object goes: Failed.
  A controller that misses that status update sees the pod missing instead: Error "pod deleted"
  (`TwinExecution.delete_pod` with a grace period models that case).

Rules and their sources:
- Argo workflow/controller/operator.go inferFailedReason: a Failed pod with a `status.message` becomes a
  Failed node with that message; without one, the main container's non-zero terminated state gives Failed
  "main: <reason> (exit code N)" (Argo's own operator_test.go TestPodFailureWithContainerOOM: OOMKilled ->
  Failed); a pod with no container status gives Failed "can't find failed message for pod ...". None of
  these kinds is `Error`, so stock KFP 2.17's templateDefaults `retryPolicy: OnError` (processNodeRetries)
  never retries them.
- Graceful node shutdown (spot preemption on GKE/Azure; any node reboot with shutdownGracePeriod):
  kubelet pkg/kubelet/nodeshutdown (nodeShutdownReason "Terminated", nodeShutdownMessage "Pod was
  terminated in response to imminent node shutdown."), SIGTERM then SIGKILL after the pod's share of
  shutdownGracePeriod; the pod object stays Failed with a DisruptionTarget condition.
- Node-pressure eviction: kubelet pkg/kubelet/eviction/helpers.go (Reason "Evicted", nodeLowMessageFmt "The
  node was low on resource: %v. ", thresholdMetMessageFmt "Threshold quantity: %v, available: %v. "); a
  hard threshold kills with grace period 0 (eviction_manager.go evictPod gracePeriodOverride); the pod
  object stays Failed. Argo also marks its task result complete (operator.go assessNodeStatus, Evicted).
- OOM kill: with cgroup v2 the kubelet sets memory.oom.group=1 on every container (Kubernetes >= 1.28,
  unless the kubelet's singleProcessOOMKill is set), so an OOM kills every process of the container; the
  runtime reports the container terminated "OOMKilled", exit code 137; the pod has no message.
- Admission: kubelet pkg/kubelet/cm/devicemanager + lifecycle admission (Reason "UnexpectedAdmissionError",
  Message "Allocate failed due to %v, which is unexpected"); the pod is Failed without ever running a
  container and stays.
- Drain: `kubectl drain` uses the eviction API: the pod gets a DisruptionTarget condition and a graceful
  delete; the kubelet stops it (SIGTERM, SIGKILL after terminationGracePeriodSeconds), moves it to a
  terminal phase (Failed: the main container exited non-zero, restartPolicy Never) and then removes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

FAILED = "Failed"


@dataclass(frozen=True)
class FailureKind:
    name: str
    graceful: bool
    """SIGTERM first and SIGKILL after the grace period (else SIGKILL at once)."""
    pod_reason: str
    """The pod's status.reason ("" when the kubelet sets none)."""
    pod_message: str
    """The pod's status.message ("" when the kubelet sets none)."""
    container_reason: str | None
    """The main container's terminated reason (None: no container ran, or it is the exit code's "Error")."""
    pod_stays: bool
    """Whether the pod object is still there, Failed, after it ended."""

    def argo_message(self, exit_code: int | None) -> str:
        """The node message operator.go inferFailedReason derives from the pod."""
        if self.pod_message:
            return self.pod_message
        code = 137 if exit_code is None else exit_code
        return f"main: {self.container_reason or 'Error'} (exit code {code})"


EVICTION_MESSAGE = (
    "The node was low on resource: memory. Threshold quantity: 100Mi, available: 60Mi. "
    "Container main was using 30Gi, request is 32Gi, has larger consumption of memory. "
)
ADMISSION_MESSAGE = (
    "Allocate failed due to requested number of devices unavailable for nvidia.com/gpu. "
    "Requested: 1, Available: 0, which is unexpected"
)
KINDS: dict[str, FailureKind] = {
    k.name: k
    for k in (
        FailureKind(
            "preempt",
            graceful=True,
            pod_reason="Terminated",
            pod_message="Pod was terminated in response to imminent node shutdown.",
            container_reason=None,
            pod_stays=True,
        ),
        FailureKind("evict", False, "Evicted", EVICTION_MESSAGE, None, pod_stays=True),
        FailureKind("oom", False, "", "", "OOMKilled", pod_stays=True),
        FailureKind("admission", False, "UnexpectedAdmissionError", ADMISSION_MESSAGE, None, pod_stays=True),
        FailureKind("drain", True, "", "", None, pod_stays=False),
    )
}


def failure_kind(name: str) -> FailureKind:
    try:
        return KINDS[name]
    except KeyError:
        raise ValueError(f"unknown failure kind {name!r}: one of {', '.join(KINDS)}") from None


def signal_exit_code(returncode: int | None) -> int | None:
    """A container's exit code for a process's return code (a signal N reads as 128 + N)."""
    if returncode is None:
        return None
    return 128 - returncode if returncode < 0 else returncode


def overlay_transient_pattern(controller_env: str | Path) -> str:
    """TRANSIENT_ERROR_PATTERN as manifests/argo-retry/controller-env.yaml sets it on the controller."""
    doc = yaml.safe_load(Path(controller_env).read_text())
    for container in doc["spec"]["template"]["spec"]["containers"]:
        for env in container.get("env", []):
            if env["name"] == "TRANSIENT_ERROR_PATTERN":
                return env["value"]
    raise ValueError(f"{controller_env}: no TRANSIENT_ERROR_PATTERN")
