"""The Kubernetes side: nodes and secrets of a pretend cluster, scheduling by labels, env, names, hostnames.

Design choices:
- A pod that fits no node even on an empty cluster (selector, taints, capacity) is *unschedulable*; a pod
  that would fit but for the GPUs other running pods hold waits (`PodPending.permanent` False). Only
  extended resources (GPUs) are accounted; cpu/memory requests are checked against allocatable, not summed:
  every process runs on this one machine anyway.
- A secretKeyRef that cannot be satisfied keeps the pod Pending (kubelet: CreateContainerConfigError, which it
  retries forever); the twin turns both kinds of "Pending forever" into a task failure after a short wait.

Rules and their sources (Kubernetes; no Kubernetes mirror is on disk, these are stated from the named code):
- Pod hostname: the kubelet truncates the pod name to 63 characters, then trims trailing '-' and '.'
  (pkg/kubelet/kubelet_pods.go truncatePodHostnameIfNeeded); HOSTNAME in the container is that hostname.
- generateName: base[:58] + 5 random characters from "bcdfghjklmnpqrstvwxz2456789"
  (k8s.io/apiserver/pkg/storage/names/generate.go SimpleNameGenerator, k8s.io/apimachinery/pkg/util/rand).
- Command/args expansion: `$(VAR)` becomes the container env var's value when VAR is defined and stays
  literal otherwise, `$$` becomes `$` (kubelet ExpandContainerCommandAndArgs ->
  third_party/forked/golang/expansion/expand.go Expand); env values may reference earlier env vars.
- secretKeyRef: a missing secret or key fails container creation (CreateContainerConfigError, pod Pending)
  unless `optional: true`, which leaves the variable unset (pkg/kubelet/kubelet_pods.go
  makeEnvironmentVariables).
- Downward API fieldRef: metadata.name/namespace/uid, metadata.labels['k'] and metadata.annotations['k']
  ("" when absent), spec.nodeName, spec.serviceAccountName, status.podIP/hostIP
  (pkg/fieldpath ExtractFieldPathAsString).
- Scheduling: every nodeSelector pair must be a node label; every NoSchedule/NoExecute taint must be tolerated
  (k8s.io/api core/v1 Toleration.ToleratesTaint: empty effect matches all, empty key + Exists matches all
  keys, Exists ignores the value, Equal compares it); requests must fit allocatable; an extended resource
  limit is also its request (scheduler NodeResourcesFit, NodeAffinity, TaintToleration plugins).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import Any

from tests.twin.platform import EnvVar, PodSpec, quantity

HOSTNAME_MAX = 63
_ALPHANUMS = "bcdfghjklmnpqrstvwxz2456789"
_FIELD = re.compile(r"metadata\.(labels|annotations)\['(.+)'\]")


@dataclass
class Node:
    name: str
    labels: dict[str, str]
    taints: list[dict[str, str]] = field(default_factory=list)
    allocatable: dict[str, str] = field(default_factory=dict)


def default_nodes() -> list[Node]:
    """One CPU node and one GPU node labelled as GKE labels them: no `nvidia.com/gpu.present` (that label
    comes from NVIDIA's GPU feature discovery, which GKE does not run), a `nvidia.com/gpu` taint."""
    common = {
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
        "topology.kubernetes.io/region": "europe-west4",
        "topology.kubernetes.io/zone": "europe-west4-a",
    }
    cpu = Node(
        "gke-twin-cpu-pool-1a2b3c4d-x1y2",
        {
            **common,
            "kubernetes.io/hostname": "gke-twin-cpu-pool-1a2b3c4d-x1y2",
            "cloud.google.com/gke-nodepool": "cpu-pool",
            "node.kubernetes.io/instance-type": "e2-standard-16",
            "cloud.google.com/machine-family": "e2",
        },
        allocatable={"cpu": "15", "memory": "57Gi"},
    )
    gpu = Node(
        "gke-twin-gpu-pool-5e6f7a8b-z3w4",
        {
            **common,
            "kubernetes.io/hostname": "gke-twin-gpu-pool-5e6f7a8b-z3w4",
            "cloud.google.com/gke-nodepool": "gpu-pool",
            "node.kubernetes.io/instance-type": "a2-highgpu-4g",
            "cloud.google.com/machine-family": "a2",
            "cloud.google.com/gke-accelerator": "nvidia-tesla-a100",
            "cloud.google.com/gke-gpu": "true",
        },
        taints=[{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}],
        allocatable={"cpu": "46", "memory": "300Gi", "nvidia.com/gpu": "4"},
    )
    return [cpu, gpu]


@dataclass
class Cluster:
    namespace: str = "kubeflow"
    nodes: list[Node] = field(default_factory=default_nodes)
    secrets: dict[str, dict[str, str]] = field(default_factory=dict)
    service_account: str = "pipeline-runner"
    namespace_labels: dict[str, str] = field(default_factory=dict)
    """The run namespace's labels: `istio-injection: enabled`, `pod-security.kubernetes.io/enforce`
    (admission.py) act on the pods a step creates."""
    istio_native_sidecars: bool = False
    """Istio injects its proxy as a native sidecar (an init container with restartPolicy Always)."""
    queues: dict[str, dict[str, str]] | None = None
    """Kueue's LocalQueues and their quota (kueue.py); None: no Kueue in the cluster."""
    web_identities: dict[str, Any] = field(default_factory=dict)
    """Service account -> its `identity.WebIdentity` (EKS IRSA): env its pods get from the identity webhook."""


class PodPending(Exception):
    def __init__(self, reason: str, message: str, permanent: bool) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason, self.message, self.permanent = reason, message, permanent


def pod_hostname(pod_name: str) -> str:
    """kubelet truncatePodHostnameIfNeeded."""
    if len(pod_name) <= HOSTNAME_MAX:
        return pod_name
    truncated = pod_name[:HOSTNAME_MAX].rstrip("-.")
    if not truncated:
        raise ValueError(f"hostname for pod {pod_name!r} was invalid")
    return truncated


def generate_name(base: str, rng: random.Random | None = None) -> str:
    """metadata.generateName -> name (SimpleNameGenerator)."""
    rng = rng or random.Random()
    return base[:58] + "".join(rng.choice(_ALPHANUMS) for _ in range(5))


def expand(text: str, env: dict[str, str]) -> str:
    """third_party/forked/golang/expansion Expand with the container env as mapping."""
    out, i = [], 0
    while i < len(text):
        if text[i] == "$" and i + 1 < len(text):
            nxt = text[i + 1]
            if nxt == "$":
                out.append("$")
                i += 2
                continue
            if nxt == "(":
                close = text.find(")", i + 2)
                if close != -1:
                    name = text[i + 2 : close]
                    out.append(env[name] if name in env else f"$({name})")
                    i = close + 1
                    continue
                out.append("$(")
                i += 2
                continue
            out.append("$" + nxt)
            i += 2
            continue
        out.append(text[i])
        i += 1
    return "".join(out)


def tolerates(tol: dict[str, Any], taint: dict[str, str]) -> bool:
    """Toleration.ToleratesTaint."""
    if tol.get("effect") and tol["effect"] != taint.get("effect"):
        return False
    if tol.get("key") and tol["key"] != taint.get("key"):
        return False
    op = tol.get("operator") or "Equal"
    if op == "Exists":
        return True
    return op == "Equal" and tol.get("key", "") != "" and tol.get("value", "") == taint.get("value", "")


def _why_not(pod: PodSpec, node: Node, used: dict[str, float]) -> str | None:
    if any(node.labels.get(k) != v for k, v in pod.node_selector.items()):
        return "didn't match Pod's node affinity/selector"
    for taint in node.taints:
        if taint.get("effect") in ("NoSchedule", "NoExecute") and not any(
            tolerates(t, taint) for t in pod.tolerations
        ):
            return f"had untolerated taint {{{taint['key']}: {taint.get('value', '')}}}"
    wants = {**pod.requests, **{k: v for k, v in pod.limits.items() if k not in ("cpu", "memory")}}
    for res, q in wants.items():
        have = quantity(node.allocatable.get(res, "0")) - used.get(res, 0.0)
        if quantity(q) > have:
            return f"Insufficient {res}"
    return None


def schedule(pod: PodSpec, nodes: list[Node], used: dict[str, dict[str, float]]) -> Node:
    """The node a pod lands on, or PodPending (permanent when no node would fit even if empty)."""
    reasons: dict[str, int] = {}
    for node in nodes:
        why = _why_not(pod, node, used.get(node.name, {}))
        if why is None:
            return node
        reasons[why] = reasons.get(why, 0) + 1
    permanent = all(_why_not(pod, n, {}) is not None for n in nodes)
    detail = ", ".join(f"{n} node(s) {r}" for r, n in sorted(reasons.items()))
    raise PodPending("Unschedulable", f"0/{len(nodes)} nodes are available: {detail}.", permanent)


def field_value(path: str, pod: dict[str, Any]) -> str:
    """pkg/fieldpath ExtractFieldPathAsString for the paths a pod env may use."""
    m = _FIELD.fullmatch(path)
    if m:
        return pod[m.group(1)].get(m.group(2), "")
    simple = {
        "metadata.name": pod["name"],
        "metadata.namespace": pod["namespace"],
        "metadata.uid": pod["uid"],
        "spec.nodeName": pod["node"],
        "spec.serviceAccountName": pod["service_account"],
        "status.podIP": "127.0.0.1",
        "status.hostIP": "127.0.0.1",
    }
    if path not in simple:
        raise ValueError(f'Pod "{pod["name"]}" is invalid: fieldPath {path!r}: Unsupported value')
    return simple[path]


def container_env(
    env: list[EnvVar], pod: dict[str, Any], secrets: dict[str, dict[str, str]]
) -> dict[str, str]:
    """The container's environment (later entries of the same name win, as in a strategic-merge patch)."""
    out: dict[str, str] = {}
    for e in env:
        if e.secret is not None:
            name, key, optional = e.secret
            secret = secrets.get(name)
            if secret is None or key not in secret:
                if optional:
                    continue
                msg = (
                    f'secret "{name}" not found'
                    if secret is None
                    else f"couldn't find key {key} in Secret {pod['namespace']}/{name}"
                )
                raise PodPending("CreateContainerConfigError", msg, permanent=True)
            out[e.name] = secret[key]
        elif e.field_path is not None:
            out[e.name] = field_value(e.field_path, pod)
        else:
            out[e.name] = expand(e.value or "", out)
    return out
