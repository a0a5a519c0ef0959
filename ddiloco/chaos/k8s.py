"""The Kubernetes chaos backend: delete the pods of one Argo workflow through the Kubernetes API.

This is what the pipeline's chaos step runs next to the learners and the syncer (`ddiloco chaos`, with the
runner of `ddiloco.chaos.runner`); `ddiloco run` fires at its own processes instead (`chaos.local`). The
schedule and clock are every backend's (`schedule_from_config`, `at_s` from `prepared_at`). A pod is deleted
only if the API lists it under the role's label selector and this run's workflow label, checked again here;
nothing else is touched. A kill is a delete with grace period 0 (SIGKILL, like a node loss); the keeper, or
KFP's retry of the task pod, starts the next incarnation (docs/cluster.md, "Retries"). The Kubernetes client
is imported only when a backend connects, so importing this module pulls in neither kubernetes nor kfp.

Design notes: docs/internals.md, "Chaos".
"""

from __future__ import annotations

from typing import Any

from ddiloco.chaos.runner import Outcome
from ddiloco.chaos.victims import ReportedVictims

ROLE_LABEL = "ddiloco.io/role"
WORKFLOW_LABEL = "workflows.argoproj.io/workflow"
DEFAULT_SELECTOR = f"{ROLE_LABEL} in (learner,syncer)"
SA_NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


class ChaosBackendError(ValueError):
    """The backend cannot work (no namespace, no permission to list pods, ...); the message says what to fix.
    A ValueError so that the CLI prints it as one line with exit code 2."""


class KubernetesPods(ReportedVictims):
    """Deletes pods of one Argo workflow through the Kubernetes API (the official client, imported lazily)."""

    name = "k8s"

    def __init__(self, api: Any, namespace: str, workflow: str, selector: str = DEFAULT_SELECTOR) -> None:
        if not workflow:
            raise ChaosBackendError(
                "the kubernetes backend needs the run's workflow name: pass --workflow or set "
                "DDILOCO_K8S_WORKFLOW (the pipeline sets it from the pod label " + WORKFLOW_LABEL + ")"
            )
        self.api, self.namespace, self.workflow = api, namespace, workflow
        self.selector = f"{selector},{WORKFLOW_LABEL}={workflow}"

    @classmethod
    def connect(
        cls, namespace: str, workflow: str, selector: str = DEFAULT_SELECTOR, host: str | None = None
    ) -> KubernetesPods:
        """In-cluster service account first, then ~/.kube/config; `host` talks to that API URL unauthenticated."""
        from kubernetes import client, config

        if host:
            conf = client.Configuration()
            conf.host = host
            return cls(client.CoreV1Api(client.ApiClient(conf)), namespace, workflow, selector)
        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        return cls(client.CoreV1Api(), namespace, workflow, selector)

    def pods(self) -> dict[str, str]:
        """Live pods of this run that the selector names: pod name -> role label."""
        from kubernetes.client.exceptions import ApiException

        try:
            listed = self.api.list_namespaced_pod(
                self.namespace, label_selector=self.selector, _request_timeout=30
            )
        except ApiException as e:
            raise ChaosBackendError(
                f"cannot list pods in namespace {self.namespace!r} (HTTP {e.status} {e.reason}): the chaos step's "
                "service account needs list/delete on pods there (manifests/base/chaos-rbac.yaml)"
            ) from None
        out = {}
        for pod in listed.items:
            labels = pod.metadata.labels or {}
            phase = pod.status.phase if pod.status is not None else None
            # Checked again here: a victim must carry this run's workflow label whatever the API returned.
            if labels.get(WORKFLOW_LABEL) != self.workflow or pod.metadata.deletion_timestamp is not None:
                continue
            if phase in ("Succeeded", "Failed") or labels.get(ROLE_LABEL) not in ("learner", "syncer"):
                continue
            out[pod.metadata.name] = labels[ROLE_LABEL]
        return out

    def kill(self, role: str, host: str, pid: int | None) -> Outcome | None:
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        if self.pods().get(host) != role:
            return None  # not (yet) a live pod of this run with that role
        try:
            self.api.delete_namespaced_pod(
                host,
                self.namespace,
                grace_period_seconds=0,
                body=client.V1DeleteOptions(grace_period_seconds=0),
                _request_timeout=30,
            )
        except ApiException as e:
            if e.status == 404:
                return Outcome("skipped (pod already gone)", {"pod": host})
            raise ChaosBackendError(
                f"cannot delete pod {host!r} in {self.namespace!r} (HTTP {e.status} {e.reason}): grant the chaos "
                "step's service account delete on pods (manifests/base/chaos-rbac.yaml)"
            ) from None
        where = {"pod": host, "namespace": self.namespace, "workflow": self.workflow, "grace_period_s": 0}
        return Outcome("deleted pod", where)
