"""The kustomize manifests: every overlay builds with `kubectl kustomize`, and every object it yields
validates strictly (`kubernetes-validate --strict` schemas for built-in kinds; custom resources against the
schema of their own CRD, below), and the Argo retry Component merges into KFP's controller ConfigMap."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = ROOT / "manifests"
OVERLAYS = sorted(p.parent for p in (MANIFESTS / "overlays").glob("*/kustomization.yaml"))
K8S_VERSIONS = ("1.29.0", kubernetes_validate.utils.latest_version())

pytestmark = pytest.mark.skipif(
    shutil.which("kubectl") is None, reason="needs kubectl (apt-get install kubectl) for `kubectl kustomize`"
)

# --- custom resources: the fields of their CRDs' openAPIV3Schema that these manifests use, strict ----------
_STR_LIST = {"type": "array", "items": {"type": "string"}}
_RELABEL = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "action": {"enum": ["replace", "Replace", "keep", "Keep", "drop", "Drop", "hashmod", "HashMod", "labelmap",
                            "LabelMap", "labeldrop", "LabelDrop", "labelkeep", "LabelKeep", "lowercase", "Lowercase",
                            "uppercase", "Uppercase", "keepequal", "KeepEqual", "dropequal", "DropEqual"]},
        "modulus": {"type": "integer"},
        "regex": {"type": "string"},
        "replacement": {"type": "string"},
        "separator": {"type": "string"},
        "sourceLabels": _STR_LIST,
        "targetLabel": {"type": "string"},
    },
}  # fmt: skip
_DURATION = {
    "type": "string",
    "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$",
}
PODMONITOR_V1 = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "PodMonitor"},
        "metadata": {"type": "object"},
        "spec": {
            "type": "object",
            "required": ["selector"],
            "additionalProperties": False,
            "properties": {
                "jobLabel": {"type": "string"},
                "podTargetLabels": _STR_LIST,
                "namespaceSelector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {"any": {"type": "boolean"}, "matchNames": _STR_LIST},
                },
                "selector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
                        "matchExpressions": {
                            "type": "array",
                            "items": {
                                "type": "object",
                                "required": ["key", "operator"],
                                "additionalProperties": False,
                                "properties": {
                                    "key": {"type": "string"},
                                    "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                                    "values": _STR_LIST,
                                },
                            },
                        },
                    },
                },
                "podMetricsEndpoints": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "path": {"type": "string"},
                            "port": {"type": "string"},
                            "portNumber": {"type": "integer", "minimum": 1, "maximum": 65535},
                            "scheme": {"enum": ["http", "https", "HTTP", "HTTPS"]},
                            "interval": _DURATION,
                            "scrapeTimeout": _DURATION,
                            "honorLabels": {"type": "boolean"},
                            "relabelings": {"type": "array", "items": _RELABEL},
                            "metricRelabelings": {"type": "array", "items": _RELABEL},
                        },
                    },
                },
            },
        },
    },
}
"""The monitoring.coreos.com/v1 PodMonitor fields used here, with the types, enums and patterns of the
prometheus-operator CRD (required: spec.selector); unknown fields are errors, as `--strict` makes them for
built-in kinds."""
CUSTOM_SCHEMAS = {("monitoring.coreos.com/v1", "PodMonitor"): PODMONITOR_V1}


def kustomize(path: Path) -> list[dict]:
    out = subprocess.run(["kubectl", "kustomize", str(path)], capture_output=True, text=True, check=False)
    assert out.returncode == 0, f"kubectl kustomize {path.relative_to(ROOT)} failed:\n{out.stderr}"
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def validate_strict(obj: dict, version: str) -> None:
    schema = CUSTOM_SCHEMAS.get((obj["apiVersion"], obj["kind"]))
    if schema is not None:
        jsonschema.validate(obj, schema)
        return
    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.SchemaNotFoundError:
        pytest.fail(
            f"{obj['apiVersion']} {obj['kind']} has no schema: add its CRD's schema to CUSTOM_SCHEMAS"
        )


def test_there_are_overlays_for_kubeflow_and_standalone():
    assert {p.name for p in OVERLAYS} == {"kubeflow", "standalone", "standalone-own-store"}


def test_standalone_uses_the_store_current_kfp_ships_and_a_seaweedfs_of_its_own_is_an_option():
    """KFP >= 2.16 standalone ships SeaweedFS (seaweedfs.kubeflow:9000), which the pipeline defaults name;
    standalone-own-store deploys the same server (no MinIO anywhere) with the store Secret's keys."""
    from ddiloco.components.params import PRETRAIN, defaults

    kinds = {(o["kind"], o["metadata"]["name"]) for o in kustomize(MANIFESTS / "overlays" / "standalone")}
    assert not any("seaweedfs" in name for _, name in kinds)
    default = defaults(PRETRAIN)
    assert default["s3_endpoint"] == "seaweedfs.kubeflow:9000" and default["store_bucket"] == "mlpipeline"
    own = {
        (o["kind"], o["metadata"]["name"]): o
        for o in kustomize(MANIFESTS / "overlays" / "standalone-own-store")
    }
    assert not any("minio" in name for _, name in own)
    assert {
        ("Deployment", "ddiloco-seaweedfs"),
        ("Service", "ddiloco-seaweedfs"),
        ("NetworkPolicy", "ddiloco-seaweedfs"),
    } <= set(own)
    (container,) = own["Deployment", "ddiloco-seaweedfs"]["spec"]["template"]["spec"]["containers"]
    assert container["image"].split("@")[0].rsplit(":", 1)[0] == "ghcr.io/chrislusf/seaweedfs"
    # the credentials the pipeline's store_secret maps (keys accesskey / secretkey) are the server's identity
    env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"]}
    assert env == {
        "AWS_ACCESS_KEY_ID": {"name": "ddiloco-store", "key": "accesskey"},
        "AWS_SECRET_ACCESS_KEY": {"name": "ddiloco-store", "key": "secretkey"},
    }
    service = own["Service", "ddiloco-seaweedfs"]["spec"]["ports"]
    assert [(p["port"], p["targetPort"]) for p in service] == [(9000, "s3")]


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: p.name)
def test_overlay_builds_and_every_object_validates_strictly(overlay):
    objects = kustomize(overlay)
    assert objects
    for obj in objects:
        for version in K8S_VERSIONS:
            try:
                validate_strict(obj, version)
            except (jsonschema.ValidationError, kubernetes_validate.ValidationError) as e:
                pytest.fail(
                    f"{overlay.name}: {obj['kind']}/{obj['metadata']['name']} (k8s {version}): {e.message}"
                )
        assert obj["kind"] != "Secret", "credentials never live in the repository"
        assert obj["metadata"].get("namespace"), f"{obj['kind']}/{obj['metadata']['name']} has no namespace"


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: p.name)
def test_every_pod_template_opts_out_of_istio_and_passes_pod_security_restricted(overlay):
    """Jobs and Deployments of the manifests: the opt-out KFP 2.17 puts on its own pods (annotation
    `sidecar.istio.io/inject: "false"`), and the twin's Pod Security `restricted` check (tests/twin/
    admission.py, the rules of k8s.io/pod-security-admission) on their pod templates."""
    from tests.twin.admission import pod_security

    templates = [o for o in kustomize(overlay) if o["kind"] in ("Job", "Deployment", "StatefulSet")]
    for obj in templates:
        tmpl = obj["spec"]["template"]
        name = f"{overlay.name}: {obj['kind']}/{obj['metadata']['name']}"
        assert tmpl["metadata"]["annotations"]["sidecar.istio.io/inject"] == "false", name
        pod = {"metadata": {"name": obj["metadata"]["name"]}, "spec": tmpl["spec"]}
        assert pod_security({"pod-security.kubernetes.io/enforce": "restricted"}, pod) == "", name


def test_strict_validation_catches_a_typo():
    (pm,) = [o for o in kustomize(MANIFESTS / "monitoring") if o["kind"] == "PodMonitor"]
    pm["spec"]["podMetricsEndpoints"][0]["intervall"] = "15s"
    with pytest.raises(jsonschema.ValidationError):
        validate_strict(pm, K8S_VERSIONS[-1])
    (role,) = [
        o
        for o in kustomize(MANIFESTS / "base")
        if o["metadata"]["name"] == "ddiloco-chaos" and o["kind"] == "Role"
    ]
    role["rules"][0]["verb"] = ["get"]
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_strict(role, K8S_VERSIONS[-1])


def _rbac(name: str) -> dict[str, dict]:
    """overlay -> {Role, RoleBinding} named `name`."""
    return {
        p.name: {o["kind"]: o for o in kustomize(p) if o["metadata"]["name"] == name and "Role" in o["kind"]}
        for p in OVERLAYS
    }


def test_chaos_rbac_is_list_and_delete_pods_only_bound_to_the_pipeline_runner():
    by_overlay = _rbac("ddiloco-chaos")
    overlays = (
        ("kubeflow", "default-editor"),
        ("standalone", "pipeline-runner"),
        ("standalone-own-store", "pipeline-runner"),
    )
    for name, sa in overlays:
        objs = by_overlay[name]
        assert objs["Role"]["rules"] == [
            {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "delete"]}
        ]
        assert objs["RoleBinding"]["subjects"] == [{"kind": "ServiceAccount", "name": sa}]
        assert objs["RoleBinding"]["metadata"]["namespace"] == objs["Role"]["metadata"]["namespace"]


def test_keeper_rbac_is_namespaced_pods_trainjobs_and_a_workflow_read_bound_to_the_pipeline_runner():
    """The keeper creates, reads, lists and deletes its workers - pods, or a multi-node learner's TrainJobs
    (components/keeper_loop.py KubePods, KubeTrainJobs) - and reads its own pod and its Workflow: a Role in
    the run's namespace, no ClusterRole."""
    by_overlay = _rbac("ddiloco-keeper")
    for name, sa in (
        ("kubeflow", "default-editor"),
        ("standalone", "pipeline-runner"),
        ("standalone-own-store", "pipeline-runner"),
    ):
        objs = by_overlay[name]
        assert objs["Role"]["rules"] == [
            {"apiGroups": [""], "resources": ["pods"], "verbs": ["create", "get", "list", "watch", "delete"]},
            {"apiGroups": ["argoproj.io"], "resources": ["workflows"], "verbs": ["get"]},
            {
                "apiGroups": ["trainer.kubeflow.org"],
                "resources": ["trainjobs"],
                "verbs": ["create", "get", "list", "delete"],
            },
        ]
        assert objs["RoleBinding"]["subjects"] == [{"kind": "ServiceAccount", "name": sa}]
        assert objs["RoleBinding"]["roleRef"]["name"] == "ddiloco-keeper"
        assert objs["RoleBinding"]["metadata"]["namespace"] == objs["Role"]["metadata"]["namespace"]
    assert not any(
        o["kind"].startswith("Cluster")
        for p in OVERLAYS
        for o in kustomize(p)
        if "ddiloco" in o["metadata"]["name"]
    )


def test_podmonitor_scrapes_the_port_the_pipeline_serves_metrics_on():
    from ddiloco.pipelines.pretrain import ClusterOptions

    (pm,) = [o for o in kustomize(MANIFESTS / "monitoring") if o["kind"] == "PodMonitor"]
    address = [
        r
        for r in pm["spec"]["podMetricsEndpoints"][0]["relabelings"]
        if r.get("targetLabel") == "__address__"
    ]
    assert address[0]["replacement"] == f"${{1}}:{ClusterOptions().metrics_port}"
    assert pm["spec"]["selector"]["matchExpressions"][0]["values"] == ["learner", "syncer"]


# KFP 2.17.0's stock workflowDefaults, as shipped in manifests/kustomize/third-party/argo/base/
# workflow-controller-configmap-patch.yaml, and its controller's TRANSIENT_ERROR_PATTERN
# (workflow-controller-deployment-patch.yaml): the facts the tests hold our patches against.
KFP_217_WORKFLOW_DEFAULTS = {
    "spec": {
        "ttlStrategy": {
            "secondsAfterCompletion": 3600,
            "secondsAfterSuccess": 3600,
            "secondsAfterFailure": 3600,
        },
        "templateDefaults": {"retryStrategy": {"limit": "2", "retryPolicy": "OnError"}},
    }
}
KFP_217_TRANSIENT = "(?i)(imminent node shutdown|node is shutting down|preempt|evict|spot|pod deleted)"
KFP_217_CONTROLLER = {
    "apiVersion": "apps/v1",
    "kind": "Deployment",
    "metadata": {"name": "workflow-controller", "namespace": "kubeflow"},
    "spec": {
        "selector": {"matchLabels": {"app": "workflow-controller"}},
        "template": {
            "metadata": {"labels": {"app": "workflow-controller"}},
            "spec": {
                "containers": [
                    {
                        "name": "workflow-controller",
                        "image": "quay.io/argoproj/workflow-controller:v4.0.5",
                        "env": [{"name": "TRANSIENT_ERROR_PATTERN", "value": KFP_217_TRANSIENT}],
                    }
                ]
            },
        },
    },
}
# What Argo v4.0.5 says for each failure the overlay must bring back (tests/twin/failures.py has the rules).
FAILURE_MESSAGES = (
    "pod deleted",
    "Pod was terminated in response to imminent node shutdown.",
    "The node was low on resource: memory. Threshold quantity: 100Mi, available: 60Mi. ",
    "main: OOMKilled (exit code 137)",
    "Allocate failed due to requested number of devices unavailable for nvidia.com/gpu. Requested: 1, "
    "Available: 0, which is unexpected",
    "main: Error (exit code 143)",
)


def _controller_config(tmp_path, data):
    (tmp_path / "kfp-controller-config.yaml").write_text(
        yaml.safe_dump_all(
            [
                {
                    "apiVersion": "v1", "kind": "ConfigMap",
                    "metadata": {"name": "workflow-controller-configmap", "namespace": "kubeflow"}, "data": data,
                },
                KFP_217_CONTROLLER,
            ]
        )
    )  # fmt: skip
    component = os.path.relpath(MANIFESTS / "argo-retry", tmp_path)
    (tmp_path / "kustomization.yaml").write_text(
        yaml.safe_dump({"resources": ["kfp-controller-config.yaml"], "components": [component]})
    )
    cm, deployment = sorted(kustomize(tmp_path), key=lambda o: o["kind"])
    return cm, deployment


def test_argo_retry_on_kfp_217_retries_infrastructure_failures_and_keeps_the_ttl(tmp_path):
    """Merged into KFP 2.17's stock ConfigMap and controller: the TTL stays (workflows and pods of recurring
    runs are collected), the policy becomes OnTransientError, and the controller's pattern matches what Argo
    says for a deleted, preempted, evicted, OOM-killed, admission-rejected or drained pod - not a crash."""
    stock = {
        "artifactRepository": "archiveLogs: true\n",
        "executor": "imagePullPolicy: IfNotPresent\n",
        "workflowDefaults": yaml.safe_dump(KFP_217_WORKFLOW_DEFAULTS),
    }
    cm, deployment = _controller_config(tmp_path, stock)
    assert set(cm["data"]) == set(stock)
    assert cm["data"]["artifactRepository"] == stock["artifactRepository"]
    defaults = yaml.safe_load(cm["data"]["workflowDefaults"])
    assert defaults["spec"]["ttlStrategy"] == KFP_217_WORKFLOW_DEFAULTS["spec"]["ttlStrategy"]
    # Not Always: template defaults reach DAG templates and other teams' steps too (docs/cluster.md).
    assert defaults["spec"]["templateDefaults"]["retryStrategy"] == {
        "limit": "2",
        "retryPolicy": "OnTransientError",
    }
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["image"] == KFP_217_CONTROLLER["spec"]["template"]["spec"]["containers"][0]["image"]
    (env,) = container["env"]
    pattern = re.compile(env["value"])  # Go's RE2 syntax here is also Python's
    assert all(pattern.search(m) for m in FAILURE_MESSAGES), env["value"]
    # KFP 2.17's own pattern misses eviction, OOM, admission and drain (and its policy never uses it)
    assert [m for m in FAILURE_MESSAGES if not re.search(KFP_217_TRANSIENT, m)] == list(FAILURE_MESSAGES[2:])
    for crash in (
        "main: Error (exit code 1)",
        "Pod was active on the node longer than the specified deadline",
    ):
        assert not pattern.search(crash), crash
    for obj in (cm, deployment):
        validate_strict(obj, K8S_VERSIONS[-1])
    # the same files are valid patches for `kubectl patch` on a running cluster
    patch = yaml.safe_load((MANIFESTS / "argo-retry" / "workflow-defaults.yaml").read_text())
    assert set(patch["data"]) == {"workflowDefaults"}


def test_argo_retry_on_kfp_216_adds_the_ttl_and_the_policy(tmp_path):
    """KFP <= 2.16 has no workflowDefaults: Argo's default OnFailure never retries a deleted pod (Error)."""
    cm, _ = _controller_config(tmp_path, {"artifactRepository": "archiveLogs: true\n"})
    defaults = yaml.safe_load(cm["data"]["workflowDefaults"])
    assert defaults["spec"]["ttlStrategy"] == KFP_217_WORKFLOW_DEFAULTS["spec"]["ttlStrategy"]
    assert defaults["spec"]["templateDefaults"]["retryStrategy"]["retryPolicy"] == "OnTransientError"
