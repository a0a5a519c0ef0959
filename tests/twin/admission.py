"""Admission of the pods a step creates through the API stand-in (workers.py), as a platform team's cluster adds
it: Istio's sidecar injector (a mutating webhook) and Pod Security admission (`baseline`, `restricted`). A
stand-in: the rules below, nothing else of either.

Design choices:
- Only created pods (keeper workers, TrainJob node pods) are admitted here. The twin's KFP task pods are not:
  KFP opts them out of injection itself (kubeflow/pipelines 2.17.0 backend/src/apiserver/template/
  v2_template.go, SetAnnotationsToAllTemplatesIfKeyNotExist(AnnotationKeyIstioSidecarInject, "false")),
  and what Pod Security makes of KFP's and Argo's own containers is a namespace setting docs/cluster.md
  states, not something the package can change.
- Order: mutating webhooks run before validating admission (apiserver admission chain), so the injected
  `istio-proxy` is checked by Pod Security too. The proxy is injected as Istio with its CNI plugin injects
  it (no `istio-init` container with NET_ADMIN/NET_RAW, which `baseline` refuses), with the securityContext
  Istio's injection template gives it (uid 1337, no privilege escalation, drop ALL).
- The proxy never exits: as a regular container it keeps the pod Running after the main container ended
  (the kubelet's phase is Running while any container of a restartPolicy Never pod runs:
  pkg/kubelet/kubelet_pods.go getPhase); as a native sidecar (an init container with restartPolicy Always,
  `Cluster.istio_native_sidecars`) the kubelet stops it once the main container ended and the pod ends.

Rules and their sources:
- Istio (pkg/kube/inject/webhook.go, inject.go injectRequired): the webhook sees pods of namespaces labelled
  `istio-injection=enabled`; a pod whose label, else annotation, `sidecar.istio.io/inject` is "false" is
  not injected ("The label is the new API; if both are present we prefer the label"); hostNetwork pods
  are not injected.
- Pod Security (k8s.io/pod-security-admission policy/check_*.go; admission/admission.go for the message):
  namespace label `pod-security.kubernetes.io/enforce` = privileged | baseline | restricted, version
  `pod-security.kubernetes.io/enforce-version` (default latest). baseline: no host namespaces, no privileged
  container, capabilities.add within the default set, no hostPath volumes, no hostPorts, seccomp not
  Unconfined. restricted adds: allowPrivilegeEscalation false, capabilities drop ALL (add at most
  NET_BIND_SERVICE), runAsNonRoot true (pod or every container), runAsUser not 0, seccomp RuntimeDefault or
  Localhost (pod or every container), volumes of the allowed types only. A refused pod gets 403 Forbidden:
  `pods "NAME" is forbidden: violates PodSecurity "LEVEL:VERSION": CHECK (DETAIL), ...`.
"""

from __future__ import annotations

import copy
from typing import Any

ISTIO_NAMESPACE_LABEL = "istio-injection"
ISTIO_INJECT = "sidecar.istio.io/inject"
ENFORCE = "pod-security.kubernetes.io/enforce"
ENFORCE_VERSION = "pod-security.kubernetes.io/enforce-version"
PROXY = "istio-proxy"
BASELINE_CAPS = {
    "AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD", "NET_BIND_SERVICE",
    "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT",
}  # fmt: skip
RESTRICTED_VOLUMES = {
    "configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected", "secret",
}  # fmt: skip


def wants_sidecar(namespace_labels: dict[str, str], body: dict[str, Any]) -> bool:
    """injectRequired: a labelled namespace, no opt-out on the pod (label first, then annotation)."""
    if namespace_labels.get(ISTIO_NAMESPACE_LABEL) != "enabled":
        return False
    meta, spec = body.get("metadata") or {}, body.get("spec") or {}
    if spec.get("hostNetwork"):
        return False
    value = (meta.get("labels") or {}).get(ISTIO_INJECT, (meta.get("annotations") or {}).get(ISTIO_INJECT))
    return value != "false"  # recent Istio: "true", "false", else the namespace's default (here: inject)


def inject(namespace_labels: dict[str, str], body: dict[str, Any], native: bool) -> dict[str, Any]:
    """The mutating webhook: the pod as stored, with `istio-proxy` added where `wants_sidecar`."""
    if not wants_sidecar(namespace_labels, body):
        return body
    out = copy.deepcopy(body)
    proxy = {
        "name": PROXY,
        "image": "docker.io/istio/proxyv2:1.27.0",
        "args": ["proxy", "sidecar"],
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "runAsNonRoot": True,
            "runAsUser": 1337,
            "runAsGroup": 1337,
            "readOnlyRootFilesystem": True,
        },
    }
    spec = out.setdefault("spec", {})
    if native:
        spec["initContainers"] = [*(spec.get("initContainers") or []), {**proxy, "restartPolicy": "Always"}]
    else:
        spec["containers"] = [*(spec.get("containers") or []), proxy]
    out.setdefault("metadata", {}).setdefault("annotations", {})["sidecar.istio.io/status"] = "injected"
    return out


def _containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]


def _names(cs: list[dict[str, Any]]) -> str:
    return ", ".join(f'"{c.get("name", "")}"' for c in cs)


def _one(cs: list[dict[str, Any]]) -> str:
    return "container" if len(cs) == 1 else "containers"


def _baseline(spec: dict[str, Any]) -> list[str]:
    out, cs, pod_sc = [], _containers(spec), spec.get("securityContext") or {}
    caps = [c for c in cs if set(((c.get("securityContext") or {}).get("capabilities") or {}).get("add") or []) - BASELINE_CAPS]  # fmt: skip
    if caps:
        out.append(f"non-default capabilities ({_one(caps)} {_names(caps)} must not include capabilities beyond the default set in securityContext.capabilities.add)")  # fmt: skip
    host = [k for k in ("hostNetwork", "hostPID", "hostIPC") if spec.get(k)]
    if host:
        out.append(f"host namespaces ({', '.join(f'{k}=true' for k in host)})")
    paths = [v["name"] for v in spec.get("volumes") or [] if "hostPath" in v]
    if paths:
        out.append(f"hostPath volumes ({'volume' if len(paths) == 1 else 'volumes'} {', '.join(map(repr, paths))})")  # fmt: skip
    ports = [c for c in cs if any(p.get("hostPort") for p in c.get("ports") or [])]
    if ports:
        out.append(f"hostPort ({_one(ports)} {_names(ports)} uses hostPort)")
    priv = [c for c in cs if (c.get("securityContext") or {}).get("privileged")]
    if priv:
        out.append(f"privileged ({_one(priv)} {_names(priv)} must not set securityContext.privileged=true)")
    unconfined = (pod_sc.get("seccompProfile") or {}).get("type") == "Unconfined" or any(
        ((c.get("securityContext") or {}).get("seccompProfile") or {}).get("type") == "Unconfined" for c in cs
    )
    if unconfined:
        out.append('seccompProfile (pod or containers must not set securityContext.seccompProfile.type to "Unconfined")')  # fmt: skip
    return out


def _restricted(spec: dict[str, Any]) -> list[str]:
    out, cs, pod_sc = [], _containers(spec), spec.get("securityContext") or {}

    def sc(c: dict[str, Any]) -> dict[str, Any]:
        return c.get("securityContext") or {}

    ape = [c for c in cs if sc(c).get("allowPrivilegeEscalation") is not False]
    if ape:
        out.append(f"allowPrivilegeEscalation != false ({_one(ape)} {_names(ape)} must set securityContext.allowPrivilegeEscalation=false)")  # fmt: skip
    caps = [c for c in cs if "ALL" not in ((sc(c).get("capabilities") or {}).get("drop") or [])
            or set((sc(c).get("capabilities") or {}).get("add") or []) - {"NET_BIND_SERVICE"}]  # fmt: skip
    if caps:
        out.append(f'unrestricted capabilities ({_one(caps)} {_names(caps)} must set securityContext.capabilities.drop=["ALL"])')  # fmt: skip
    vols = [v for v in spec.get("volumes") or [] if not set(v) - {"name"} <= RESTRICTED_VOLUMES]
    if vols:
        out.append(f"restricted volume types (volumes {', '.join(repr(v['name']) for v in vols)})")
    pod_nonroot = pod_sc.get("runAsNonRoot") is True
    nonroot = [c for c in cs if sc(c).get("runAsNonRoot") is False or (not pod_nonroot and sc(c).get("runAsNonRoot") is not True)]  # fmt: skip
    if nonroot:
        out.append(f"runAsNonRoot != true (pod or {_one(nonroot)} {_names(nonroot)} must set securityContext.runAsNonRoot=true)")  # fmt: skip
    root = [c for c in cs if sc(c).get("runAsUser") == 0]
    if pod_sc.get("runAsUser") == 0 or root:
        out.append(f"runAsUser=0 (pod or {_one(root or cs)} {_names(root or cs)} must not set runAsUser=0)")
    pod_seccomp = (pod_sc.get("seccompProfile") or {}).get("type") in ("RuntimeDefault", "Localhost")
    seccomp = [c for c in cs if (sc(c).get("seccompProfile") or {}).get("type") not in ("RuntimeDefault", "Localhost")
               and not (pod_seccomp and not sc(c).get("seccompProfile"))]  # fmt: skip
    if seccomp:
        out.append(f'seccompProfile (pod or {_one(seccomp)} {_names(seccomp)} must set securityContext.seccompProfile.type to "RuntimeDefault" or "Localhost")')  # fmt: skip
    return out


def pod_security(namespace_labels: dict[str, str], body: dict[str, Any]) -> str:
    """ "" if the namespace's enforced level admits the pod, else the API server's Forbidden message."""
    level = namespace_labels.get(ENFORCE, "privileged")
    if level == "privileged":
        return ""
    if level not in ("baseline", "restricted"):
        raise ValueError(
            f"the twin knows Pod Security levels privileged, baseline, restricted; not {level!r}"
        )
    spec = body.get("spec") or {}
    found = _baseline(spec) + (_restricted(spec) if level == "restricted" else [])
    if not found:
        return ""
    version = namespace_labels.get(ENFORCE_VERSION, "latest")
    name = (body.get("metadata") or {}).get("name", "")
    return f'pods "{name}" is forbidden: violates PodSecurity "{level}:{version}": {", ".join(found)}'
