"""The pod a KFP task gets: the driver's pod spec patch plus the Argo template it patches.

Design choices:
- A `PodSpec` keeps only what the twin acts on: env (plain, secretKeyRef, fieldRef), node selector,
  tolerations, resources, activeDeadlineSeconds, labels/annotations and the user command. Values are resolved
  exactly as the driver resolves them; what Kubernetes then does with them is `cluster.py`'s business.

Rules and their sources (KFP 2.17.0):
- backend/src/v2/driver/k8s.go extendPodSpecPatch:
  * nodeSelector: `nodeSelectorJson` is resolved like a task input (resolveK8sJsonParameter: the struct
    marshalled to a map; `{}` is an empty selector); a null optional input skips it; else the `labels` map.
  * tolerations: `tolerationJson` may be one toleration (struct) or a list; null or empty is skipped.
  * secretAsEnv: the name comes from `secretNameParameter` (resolveInputParameterStr: a non-empty string;
    null skips the entry) before `secretName`; `optional` is copied onto every secretKeyRef when present.
  * fieldPathAsEnv: env var with a downward-API fieldRef.
  * activeDeadlineSeconds > 0 becomes the pod's activeDeadlineSeconds.
  * emptyDirMounts: a pod volume (emptyDir: medium, sizeLimit through k8sres.MustParse, which panics on a
    bad quantity: the driver fails) and the main container's mount.
- backend/src/v2/driver/driver.go initPodSpecPatch + getPodResource: resource requests/limits from the new
  string fields (`resourceCpuRequest`, ..., a `{{$.inputs.parameters['x']}}` resolved by
  resolvePodSpecInputRuntimeParameter) before the old float fields ("%vG" memory, "%v" cpu); an accelerator
  becomes a *limit* on `resourceType` (or `type`) of `resourceCount` (or `count`); container `env` values.
- backend/src/v2/compiler/argocompiler/common.go commonEnvs (KFP_POD_NAME = metadata.name, KFP_POD_UID =
  metadata.uid) and retryIndexEnv (KFP_RETRY_INDEX = `{{retries}}`, only on templates with a KFP retry).
- backend/src/v2/compiler/argocompiler/container.go addContainerExecutorTemplate/extendPodMetadata:
  podMetadata
  labels and annotations become the executor template's metadata; argo.go Compile: every pod also gets the
  workflow's podMetadata `pipelines.kubeflow.org/v2_component: "true"`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from tests.twin.gofmt import fmt_v
from tests.twin.resolve import NullParameter, ResolveError, RunContext, Scope, resolve_parameter

V2_COMPONENT = "pipelines.kubeflow.org/v2_component"
_CHANNEL = re.compile(r"\$.inputs.parameters\['(.+?)'\]")


@dataclass
class EnvVar:
    name: str
    value: str | None = None
    secret: tuple[str, str, bool | None] | None = None
    """(secret name, key, optional)"""
    field_path: str | None = None


@dataclass
class PodSpec:
    command: list[str]
    image: str
    env: list[EnvVar] = field(default_factory=list)
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict[str, Any]] = field(default_factory=list)
    requests: dict[str, str] = field(default_factory=dict)
    limits: dict[str, str] = field(default_factory=dict)
    active_deadline_seconds: int | None = None
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)
    volumes: list[dict[str, Any]] = field(default_factory=list)
    """Pod volumes (the twin models emptyDir ones: name, medium, sizeLimit)."""
    mounts: list[dict[str, Any]] = field(default_factory=list)
    """The container's volumeMounts (name, mountPath)."""


def quantity(q: str) -> float:
    """A resource quantity as a number (cpu in cores, memory in bytes)."""
    m = re.fullmatch(r"([0-9.]+)([a-zA-Z]*)", str(q).strip())
    if not m:
        raise ValueError(f"quantities must match the regular expression: {q!r}")
    scale = {
        "": 1,
        "m": 1e-3,
        "k": 1e3,
        "M": 1e6,
        "G": 1e9,
        "T": 1e12,
        "Ki": 2**10,
        "Mi": 2**20,
        "Gi": 2**30,
        "Ti": 2**40,
    }
    if m.group(2) not in scale:
        raise ValueError(f"unsupported quantity suffix in {q!r}")
    return float(m.group(1)) * scale[m.group(2)]


def _pod_spec_runtime_param(value: str, ex_input: dict) -> str:
    """driver/resolve.go resolvePodSpecInputRuntimeParameter."""
    m = _CHANNEL.search(value)
    if not m:
        return value
    values = ex_input.get("inputs", {}).get("parameterValues", {})
    if m.group(1) not in values:
        raise ResolveError("executorInput did not contain container Image input parameter")
    v = values[m.group(1)]
    return v if isinstance(v, str) else ""  # GetStringValue()


def _resources(container: dict[str, Any], ex_input: dict) -> tuple[dict[str, str], dict[str, str]]:
    res = container.get("resources", {})
    requests: dict[str, str] = {}
    limits: dict[str, str] = {}
    for target, kind, new, old, fmt in (
        (limits, "memory", "resourceMemoryLimit", "memoryLimit", "{}G"),
        (requests, "memory", "resourceMemoryRequest", "memoryRequest", "{}G"),
        (limits, "cpu", "resourceCpuLimit", "cpuLimit", "{}"),
        (requests, "cpu", "resourceCpuRequest", "cpuRequest", "{}"),
    ):
        if res.get(new):
            target[kind] = _pod_spec_runtime_param(str(res[new]), ex_input)
        elif res.get(old):
            target[kind] = fmt.format(fmt_v(float(res[old])))
    acc = res.get("accelerator")
    if acc:
        kind = (
            _pod_spec_runtime_param(acc["resourceType"], ex_input)
            if acc.get("resourceType")
            else acc.get("type", "")
        )
        if acc.get("resourceCount"):
            count = _pod_spec_runtime_param(str(acc["resourceCount"]), ex_input)
        else:
            count = str(int(acc["count"])) if int(acc.get("count") or 0) > 0 else ""
        if kind and count:
            limits[kind] = count
    return requests, limits


def build_pod_spec(
    container: dict[str, Any],
    k8s: dict[str, Any],
    ex_input: dict,
    scope: Scope,
    run: RunContext,
    task_name: str,
    command: list[str],
    kfp_retry: bool,
) -> PodSpec:
    """initPodSpecPatch + extendPodSpecPatch + the executor template's env and metadata."""
    requests, limits = _resources(container, ex_input)
    pod = PodSpec(
        command=command,
        image=_pod_spec_runtime_param(container.get("image", ""), ex_input),
        requests=requests,
        limits=limits,
    )
    pod.env += [
        EnvVar("KFP_POD_NAME", field_path="metadata.name"),
        EnvVar("KFP_POD_UID", field_path="metadata.uid"),
    ]
    if kfp_retry:
        pod.env.append(EnvVar("KFP_RETRY_INDEX", value="{{retries}}"))
    pod.env += [EnvVar(e["name"], value=str(e.get("value", ""))) for e in container.get("env", [])]

    def resolve(spec: dict[str, Any]) -> Any:
        return resolve_parameter(spec, scope, run, task_name)

    selector = k8s.get("nodeSelector")
    if selector is not None:
        if "nodeSelectorJson" in selector:
            try:
                v = resolve(selector["nodeSelectorJson"])
                pod.node_selector = {k: str(x) for k, x in (v if isinstance(v, dict) else {}).items()}
            except NullParameter:
                pass
        else:
            pod.node_selector = dict(selector.get("labels", {}))
    for tol in k8s.get("tolerations", []):
        if "tolerationJson" not in tol:
            pod.tolerations.append(
                {k: tol[k] for k in ("key", "operator", "value", "effect", "tolerationSeconds") if k in tol}
            )
            continue
        try:
            v = resolve(tol["tolerationJson"])
        except NullParameter:
            continue
        if isinstance(v, dict):
            pod.tolerations += [v] if v else []
        elif isinstance(v, list):
            pod.tolerations += v
        else:
            raise ResolveError(
                "encountered unexpected toleration proto value, must be either struct or list type"
            )
    for entry in k8s.get("secretAsEnv", []):
        for kv in entry.get("keyToEnv", []):
            if "secretNameParameter" in entry:
                try:
                    name = resolve(entry["secretNameParameter"])
                except NullParameter:
                    continue
                if not isinstance(name, str) or not name:
                    raise ResolveError(
                        f"resolving input parameter with spec {entry['secretNameParameter']}. "
                        "Expected a non-empty string"
                    )
            elif entry.get("secretName"):
                name = entry["secretName"]
            else:
                raise ResolveError(
                    "missing either SecretName or SecretNameParameter for secret environment variable"
                )
            pod.env.append(EnvVar(kv["envVar"], secret=(name, kv["secretKey"], entry.get("optional"))))
    pod.env += [EnvVar(f["name"], field_path=f["fieldPath"]) for f in k8s.get("fieldPathAsEnv", [])]
    for m in k8s.get("emptyDirMounts", []):
        size = m.get("sizeLimit", "")
        if size:
            quantity(size)  # k8sres.MustParse: a bad quantity panics the driver
        empty = {k: v for k, v in (("medium", m.get("medium", "")), ("sizeLimit", size)) if v}
        pod.volumes.append({"name": m["volumeName"], "emptyDir": empty})
        pod.mounts.append({"name": m["volumeName"], "mountPath": m["mountPath"]})
    timeout = int(k8s.get("activeDeadlineSeconds") or 0)
    pod.active_deadline_seconds = timeout if timeout > 0 else None
    meta = k8s.get("podMetadata", {})
    pod.labels = {V2_COMPONENT: "true", **{k: str(v) for k, v in meta.get("labels", {}).items()}}
    pod.annotations = {V2_COMPONENT: "true", **{k: str(v) for k, v in meta.get("annotations", {}).items()}}
    return pod


def impl_template_name(task: dict[str, Any], component: dict[str, Any], k8s: dict[str, Any]) -> str:
    """container.go addContainerExecutorTemplate: the Argo template the executor pod runs (in its name)."""
    name = "system-container-impl"
    if task.get("retryPolicy") is not None and "dag" not in component:
        name = "retry-" + name
    meta = k8s.get("podMetadata")
    if meta is not None:
        name = f"metadata-{len(meta.get('annotations') or {})}-{len(meta.get('labels') or {})}-{name}"
    return name
