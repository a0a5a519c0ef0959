"""What every pod this package creates itself (keeper workers, TrainJob node pods) carries for a platform team's
cluster: the Istio opt-out, a Pod Security `restricted` securityContext, and the run's scheduling settings
(Kueue queue, priority class, affinity, image pull secrets, extra labels and annotations, service account).

The pods opt out of Istio sidecar injection by annotation and label, as KFP opts out its own pods: a sidecar
that never exits would keep a finished worker Running. The securityContext is the `restricted` profile with
the images' uid 1000. `PodSettings` is the run-time parameter `pod_settings` plus `kueue_queue`, applied by
`worker_manifest` and `trainjob_manifest`; the Kueue queue label goes on a worker pod itself and on a
TrainJob, not on its pods.

Design notes (the Istio, Pod Security and Kueue code each choice follows): docs/internals.md, "Pods on a
platform team's cluster".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

ISTIO_INJECT = "sidecar.istio.io/inject"
ISTIO_OPT_OUT = {ISTIO_INJECT: "false"}
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
RUN_AS = 1000
"""The images' user and group (images/learner.Dockerfile, images/syncer.Dockerfile: `USER 1000:1000`)."""
KEYS = ("priority_class", "affinity", "image_pull_secrets", "labels", "annotations", "service_account")
"""What `pod_settings` may hold (anything else is a usage error)."""


def pod_security_context() -> dict[str, Any]:
    """The pod-level part of `restricted`: who runs, and the seccomp profile."""
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS,
        "runAsGroup": RUN_AS,
        "fsGroup": RUN_AS,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security_context() -> dict[str, Any]:
    """The container-level part of `restricted` (also valid under `baseline`)."""
    return {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "runAsNonRoot": True,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


@dataclass(frozen=True)
class PodSettings:
    """A run's scheduling settings for the pods the package creates; all empty by default."""

    queue: str = ""
    """Kueue LocalQueue (`kueue.x-k8s.io/queue-name`): the workload waits until the queue admits it."""
    priority_class: str = ""
    """priorityClassName of worker pods (a TrainJob's node pods take theirs from the runtime, see
    `trainjob`)."""
    affinity: dict[str, Any] = field(default_factory=dict)
    image_pull_secrets: list[str] = field(default_factory=list)
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)
    service_account: str = ""
    """serviceAccountName of worker pods and TrainJob node pods (`keeper.placement`); empty: the keeper pod's.
    The account a cluster's identity webhook (EKS IRSA / Pod Identity) binds the store's role to."""

    @classmethod
    def of(cls, queue: str = "", settings: dict[str, Any] | None = None) -> PodSettings:
        """From the run-time parameters `kueue_queue` and `pod_settings`; ValueError names what is wrong."""
        settings = dict(settings or {})
        unknown = sorted(set(settings) - set(KEYS))
        if unknown:
            raise ValueError(f"pod_settings: unknown keys {unknown}; allowed: {list(KEYS)}")
        secrets = settings.get("image_pull_secrets") or []
        if not isinstance(secrets, list) or not all(isinstance(s, str) for s in secrets):
            raise ValueError(f"pod_settings.image_pull_secrets: a list of Secret names, got {secrets!r}")
        for key in ("affinity", "labels", "annotations"):
            if not isinstance(settings.get(key) or {}, dict):
                raise ValueError(f"pod_settings.{key}: a JSON object, got {settings[key]!r}")
        return cls(
            queue=str(queue or ""),
            priority_class=str(settings.get("priority_class") or ""),
            affinity=dict(settings.get("affinity") or {}),
            image_pull_secrets=list(secrets),
            labels={str(k): str(v) for k, v in (settings.get("labels") or {}).items()},
            annotations={str(k): str(v) for k, v in (settings.get("annotations") or {}).items()},
            service_account=str(settings.get("service_account") or ""),
        )

    def pod_labels(self, own: dict[str, str], *, queue: bool) -> dict[str, str]:
        """Extra labels, the package's own (which win), the Istio opt-out and, with `queue`, the queue."""
        out = {**self.labels, **own, **ISTIO_OPT_OUT}
        if queue and self.queue:
            out[QUEUE_LABEL] = self.queue
        return out

    def pod_annotations(self, own: dict[str, str]) -> dict[str, str]:
        return {**self.annotations, **own, **ISTIO_OPT_OUT}

    def pod_spec(self, *, priority: bool) -> dict[str, Any]:
        """Pod spec fields: securityContext always; affinity, imagePullSecrets, priorityClassName if set."""
        out: dict[str, Any] = {"securityContext": pod_security_context()}
        if self.affinity:
            out["affinity"] = dict(self.affinity)
        if self.image_pull_secrets:
            out["imagePullSecrets"] = [{"name": s} for s in self.image_pull_secrets]
        if priority and self.priority_class:
            out["priorityClassName"] = self.priority_class
        return out
