"""Each twin rule on its own, no processes: values, placeholders, retries, names, scheduling, env, API."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.twin.argo import (
    AttemptView,
    effective_retry_strategy,
    expanded_name,
    fnv32a,
    kfp_retry_strategy,
    pod_name,
    retry_decision,
)
from tests.twin.cluster import (
    Cluster,
    PodPending,
    container_env,
    default_nodes,
    expand,
    pod_hostname,
    schedule,
)
from tests.twin.dagretry import branch_phases, chain, dag_phase, dag_template_strategy, hook_runs, settle
from tests.twin.gofmt import fmt_v, format_f, intstr_int, parse_duration
from tests.twin.kubeapi import selector_matches
from tests.twin.launcher import (
    LauncherError,
    collect_outputs,
    compile_cmd_and_args,
    driver_resolve_args,
    provision_outputs,
    with_defaults,
)
from tests.twin.platform import EnvVar, PodSpec
from tests.twin.resolve import ResolveError, RunContext, resolve_inputs, special_constant
from tests.twin.workflow_defaults import KFP_2_17, load_workflow_defaults

pytestmark = pytest.mark.twin
ROOT = Path(__file__).resolve().parents[2]
RUN = RunContext(
    run_id="8f2c-run", run_name="p-abcde", run_display_name="p", create_time_utc="2026-01-01T00:00:00Z"
)
OURS = ROOT / "manifests" / "argo-retry" / "workflow-defaults.yaml"


class _Scope:
    def __init__(self, inputs: dict) -> None:
        self.inputs, self.execution_id = inputs, 7

    def task_output(self, producer: str, key: str):
        return {("prepare", "Output"): [0.0, 1.0]}[(producer, key)]

    def task_final_status(self, producer: str) -> dict:
        return {}


# --- Go formatting (argocompiler getTaskRetryParametersWithValues uses %v) ---------------------------------
def test_go_formatting_of_factors_and_numbers():
    assert [fmt_v(2.0), fmt_v(1.5), fmt_v(1.0), fmt_v(1e6), fmt_v(100)] == ["2", "1.5", "1", "1e+06", "100"]
    assert [format_f(8.0), format_f(0.5), format_f(1e-7)] == ["8", "0.5", "0.0000001"]
    assert [parse_duration("10"), parse_duration("300s"), parse_duration("1m30s")] == [10.0, 300.0, 90.0]
    with pytest.raises(ValueError, match="cannot be resolved to an int"):
        intstr_int("1.5")


# --- driver: special placeholders are whole values only ----------------------------------------------------
def test_pipeline_job_uuid_is_replaced_only_as_the_whole_constant():
    assert special_constant("{{$.pipeline_job_uuid}}", RUN, "t", 7) == "8f2c-run"
    embedded = "s3://b/{{$.pipeline_job_uuid}}"
    assert special_constant(embedded, RUN, "t", 7) == embedded
    assert special_constant("{{$.pipeline_job_resource_name}}", RUN, "t", 7) == "p-abcde"
    assert special_constant("{{$.pipeline_task_uuid}}", RUN, "t", 7) == "7"
    assert special_constant("/x{{$.workspace_path}}/y", RUN, "t", 7) == "/x/kfp-workspace/y"


def test_driver_resolves_inputs_skips_unset_optionals_and_checks_types():
    comp = {
        "inputDefinitions": {
            "parameters": {
                "store": {"parameterType": "STRING"},
                "n": {"parameterType": "NUMBER_INTEGER", "isOptional": True, "defaultValue": 3.0},
                "label": {"parameterType": "STRING", "isOptional": True},
                "ids": {"parameterType": "LIST"},
            }
        }
    }
    task = {
        "inputs": {
            "parameters": {
                "store": {
                    "runtimeValue": {"constant": "s3://{{$.inputs.parameters['pipelinechannel--b']}}/x"}
                },
                "pipelinechannel--b": {"componentInputParameter": "bucket"},
                "label": {"componentInputParameter": "maybe"},
                "ids": {"taskOutputParameter": {"producerTask": "prepare", "outputParameterKey": "Output"}},
            }
        }
    }
    values = resolve_inputs(task, comp, _Scope({"bucket": "mlp", "maybe": None}), RUN, "t")
    assert values == {
        "store": "s3://{{$.inputs.parameters['pipelinechannel--b']}}/x",
        "pipelinechannel--b": "mlp",
        "ids": [0.0, 1.0],
    }
    comp["inputDefinitions"]["parameters"]["store"]["parameterType"] = "NUMBER_INTEGER"
    with pytest.raises(ResolveError, match="type mismatch: expect NUMBER_INTEGER, got string"):
        resolve_inputs(task, comp, _Scope({"bucket": "mlp", "maybe": None}), RUN, "t")
    comp["inputDefinitions"]["parameters"]["store"]["parameterType"] = "STRING"
    task["inputs"]["parameters"]["store"] = {"componentInputParameter": "num"}
    assert (
        resolve_inputs(task, comp, _Scope({"bucket": "b", "maybe": None, "num": 8.0}), RUN, "t")["store"]
        == "8"
    )


# --- launcher: {{$}} first, then substring placeholders over the JSON ---------------------------------------
def test_launcher_resolves_channels_inside_the_executor_input_json_and_leaves_the_uuid():
    ex = {
        "inputs": {
            "parameterValues": {
                "store": "s3://{{$.inputs.parameters['pipelinechannel--b']}}/{{$.pipeline_job_uuid}}",
                "pipelinechannel--b": "mlp",
            }
        },
        "outputs": {"outputFile": "/o/out.json"},
    }
    comp = {
        "inputDefinitions": {
            "parameters": {
                "store": {"parameterType": "STRING"},
                "n": {"parameterType": "NUMBER_INTEGER", "defaultValue": 3.0, "isOptional": True},
            }
        }
    }
    argv = compile_cmd_and_args(
        with_defaults(ex, comp), "sh {{$}}", ["-ec", "x", "--executor_input", "{{$}}"]
    )
    assert argv[0].startswith('sh {"inputs"')  # the command: {{$}} only
    sent = json.loads(argv[-1])
    assert sent["inputs"]["parameterValues"]["store"] == "s3://mlp/{{$.pipeline_job_uuid}}"
    assert sent["inputs"]["parameterValues"]["n"] == 3  # addDefaultParams; protojson prints 3.0 as 3
    ex["inputs"]["parameterValues"]["gone"] = (
        None  # getPlaceholders fails -> its error is dropped -> no replacement
    )
    argv = compile_cmd_and_args(ex, "sh", ["{{$}}"])
    assert (
        "{{$.inputs.parameters['pipelinechannel--b']}}"
        in json.loads(argv[1])["inputs"]["parameterValues"]["store"]
    )


def test_driver_resolves_container_args_without_defaults():
    ex = {"inputs": {"parameterValues": {"a": 2.0}}}
    assert driver_resolve_args(["--a={{$.inputs.parameters['a']}}", "{{$}}"], ex) == ["--a=2", "{{$}}"]
    with pytest.raises(LauncherError, match="parameter 'n' not found"):
        driver_resolve_args(["{{$.inputs.parameters['n']}}"], ex)


def test_an_output_artifact_takes_the_reported_metadata_but_no_uri_outside_the_pipeline_root(tmp_path):
    """launcher_v2.go uploadOutputArtifacts + mergeRuntimeArtifacts, objectstore.Config.KeyFromURI: the
    metadata a component reports is merged into its Model artifact (type kept: MLMD records the schema
    title), a null field fails the step (metadata/converter.go StructValueToMLMDValue), and a URI it points
    elsewhere (an object of the run root) fails it too instead of being recorded: the artifact's URI always
    holds what the component wrote to its path."""
    root = tmp_path / "artifacts"
    comp = {
        "outputDefinitions": {"artifacts": {"final_model": {"artifactType": {"schemaTitle": "system.Model"}}}}
    }
    ex = {"outputs": provision_outputs(comp, root, "export-final", tmp_path / "pod", publish_logs=False)}
    provisioned = ex["outputs"]["artifacts"]["final_model"]["artifacts"][0]
    reported = {
        "name": "final_model",
        "uri": provisioned["uri"],
        "metadata": {"architecture": "GPT2LMHeadModel"},
    }
    out = Path(ex["outputs"]["outputFile"])
    out.parent.mkdir(parents=True)
    out.write_text(json.dumps({"artifacts": {"final_model": {"artifacts": [reported]}}}))
    _, arts = collect_outputs(ex, comp, root)
    art = arts["final_model"]
    assert art["type"]["schemaTitle"] == "system.Model" and art["uri"] == provisioned["uri"]
    assert art["metadata"] == {"architecture": "GPT2LMHeadModel"}
    reported["metadata"]["val_loss"] = None  # MLMD has no null custom property: the step fails
    out.write_text(json.dumps({"artifacts": {"final_model": {"artifacts": [reported]}}}))
    with pytest.raises(LauncherError, match="unable to produce MLMD artifact .*'val_loss'"):
        collect_outputs(ex, comp, root)
    reported["metadata"].pop("val_loss")
    reported["uri"] = "s3://mlpipeline/private/team-a/ddiloco/run/final"
    out.write_text(json.dumps({"artifacts": {"final_model": {"artifacts": [reported]}}}))
    with pytest.raises(LauncherError, match="does not have expected bucket prefix"):
        collect_outputs(ex, comp, root)


# --- Argo retry strategies ---------------------------------------------------------------------------------
def test_kfp_retry_policy_becomes_argo_strings():
    rp = {"maxRetryCount": 100, "backoffDuration": "10s", "backoffFactor": 2.0, "backoffMaxDuration": "300s"}
    assert kfp_retry_strategy({"retryPolicy": rp}) == {
        "limit": "100",
        "backoff": {"duration": "10", "factor": "2", "maxDuration": "300"},
    }
    assert kfp_retry_strategy({"retryPolicy": {**rp, "backoffFactor": 1.5}})["backoff"]["factor"] == "1.5"
    assert kfp_retry_strategy({}) is None


def test_template_defaults_merge_under_the_template(tmp_path):
    kfp = kfp_retry_strategy(
        {
            "retryPolicy": {
                "maxRetryCount": 3,
                "backoffDuration": "10s",
                "backoffFactor": 1.0,
                "backoffMaxDuration": "600s",
            }
        }
    )
    assert effective_retry_strategy(kfp, KFP_2_17)["retryPolicy"] == "OnError"
    assert effective_retry_strategy(kfp, KFP_2_17)["limit"] == "3"
    cm = tmp_path / "cm.yaml"
    cm.write_text(
        "kind: ConfigMap\ndata:\n  workflowDefaults: |\n    spec:\n      templateDefaults:\n"
        '        retryStrategy:\n          limit: "0"\n          retryPolicy: Always\n'
    )
    ours = load_workflow_defaults(cm)
    assert effective_retry_strategy(kfp, ours) == {**kfp, "retryPolicy": "Always"}
    assert effective_retry_strategy(None, ours) == {"limit": "0", "retryPolicy": "Always"}
    assert effective_retry_strategy(None, KFP_2_17) == {"limit": "2", "retryPolicy": "OnError"}
    assert effective_retry_strategy(kfp, None) == kfp and effective_retry_strategy(None, None) is None
    assert "templateDefaults" in load_workflow_defaults(OURS)["spec"]  # the repo's manifest loads


def _att(phase: str, start: float, end: float, msg: str = "") -> AttemptView:
    return AttemptView(
        phase, msg or {"Error": "pod deleted"}.get(phase, "main: Error (exit code 1)"), start, end
    )


def test_retry_decisions_follow_process_node_retries():
    s = {"limit": "3", "backoff": {"duration": "10", "factor": "2", "maxDuration": "300"}}
    assert retry_decision(s, [_att("Failed", 0, 5)], now=6).action == "wait"  # OnFailure by default
    d = retry_decision(s, [_att("Failed", 0, 5)], now=16)
    assert (d.action, d.execution_deadline) == ("retry", 300)  # first start + maxDuration
    two = [_att("Failed", 0, 5), _att("Failed", 16, 20)]
    assert retry_decision(s, two, now=35).until == 40  # 10 * 2^(2-1)
    assert retry_decision(s, [_att("Failed", 0, 301)], now=302).message == "Max duration limit exceeded"
    assert (
        retry_decision(s, [_att("Failed", 0, 295)], now=296).message
        == "Backoff would exceed max duration limit"
    )
    d = retry_decision(s, [_att("Error", 0, 5)], now=16)
    assert (d.action, d.phase, d.message) == ("fail", "Error", "pod deleted")
    assert "OnFailure does not retry a Error pod" in d.reason
    assert retry_decision({**s, "retryPolicy": "OnError"}, [_att("Error", 0, 5)], now=16).action == "retry"
    on_error_failed = {**s, "retryPolicy": "OnError"}
    assert (
        retry_decision(on_error_failed, [_att("Failed", 0, 5)], now=6).action == "wait"
    )  # waits, then fails
    assert retry_decision(on_error_failed, [_att("Failed", 0, 5)], now=16).action == "fail"
    assert retry_decision({**s, "retryPolicy": "Always"}, [_att("Error", 0, 5)], now=16).action == "retry"
    four = [_att("Failed", 10 * i, 10 * i + 1) for i in range(4)]
    assert retry_decision({**s, "backoff": {"duration": "0"}}, four, now=99).message == "No more retries left"
    assert (
        retry_decision(s, [_att("Failed", 0, 5)], now=16, deadline_exceeded=True).message
        == "retry exceeded workflow deadline"
    )


def test_a_fractional_backoff_factor_errors_at_the_first_failure():
    s = kfp_retry_strategy(
        {
            "retryPolicy": {
                "maxRetryCount": 3,
                "backoffDuration": "1s",
                "backoffFactor": 1.5,
                "backoffMaxDuration": "60s",
            }
        }
    )
    assert retry_decision(s, [_att("Succeeded", 0, 1)], now=2).action == "succeeded"  # never parsed
    d = retry_decision(s, [_att("Failed", 0, 1)], now=2)
    assert (d.action, d.phase, d.message) == ("error", "Error", "value '1.5' cannot be resolved to an int")


# --- names and hostnames -----------------------------------------------------------------------------------
def test_fnv_pod_names_and_63_character_hostnames():
    assert (fnv32a("a"), fnv32a("foobar")) == (0xE40C292C, 0xBF9CF968)  # FNV-1a test vectors
    node = (
        "ddiloco-pretrain-x7k2q.root.for-loop-1.iteration-iterations(0:0).iteration-item.learner.executor(1)"
    )
    name = pod_name("ddiloco-pretrain-x7k2q", node, "metadata-0-2-retry-system-container-impl")
    assert name == f"ddiloco-pretrain-x7k2q-metadata-0-2-retry-system-container-impl-{fnv32a(node)}"
    long = "ddiloco-pretrain-x7k2-metadata-0-2-retry-system-container-impl-1234567"
    assert (
        len(long) == 70
        and pod_hostname(long) == "ddiloco-pretrain-x7k2-metadata-0-2-retry-system-container-impl"
    )
    assert pod_hostname(name) == pod_hostname(name[:-3] + "999") == name[:63]  # learners share one hostname
    assert expanded_name("iteration-iterations", 2, 2) == "iteration-iterations(2:2)"


# --- scheduling, env, expansion, selectors -----------------------------------------------------------------
def _pod(**kw) -> PodSpec:
    return PodSpec(command=["sh"], image="i", **kw)


def test_scheduling_against_gke_style_nodes():
    gpu_tol = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    nodes = default_nodes()
    with pytest.raises(PodPending) as e:
        schedule(
            _pod(
                node_selector={"nvidia.com/gpu.present": "true"},
                tolerations=gpu_tol,
                limits={"nvidia.com/gpu": "1"},
            ),
            nodes,
            {},
        )
    assert e.value.permanent and "didn't match Pod's node affinity/selector" in e.value.message
    assert (
        schedule(_pod(tolerations=gpu_tol, limits={"nvidia.com/gpu": "1"}), nodes, {}).name == nodes[1].name
    )
    assert schedule(_pod(node_selector={}), nodes, {}).name == nodes[0].name  # {} matches any node
    with pytest.raises(PodPending, match="untolerated taint"):
        schedule(_pod(limits={"nvidia.com/gpu": "1"}), nodes, {})
    with pytest.raises(PodPending) as e:
        schedule(
            _pod(tolerations=gpu_tol, limits={"nvidia.com/gpu": "1"}),
            nodes,
            {nodes[1].name: {"nvidia.com/gpu": 4}},
        )
    assert not e.value.permanent and "Insufficient nvidia.com/gpu" in e.value.message


def test_secrets_and_downward_api_env():
    meta = {
        "name": "wf-x-123",
        "namespace": "kubeflow",
        "uid": "u",
        "node": "n1",
        "service_account": "sa",
        "labels": {"workflows.argoproj.io/workflow": "wf"},
        "annotations": {},
    }
    env = [
        EnvVar("A", secret=("s3", "accesskey", False)),
        EnvVar("K", secret=("run-key", "key", True)),
        EnvVar("WF", field_path="metadata.labels['workflows.argoproj.io/workflow']"),
        EnvVar("POD", field_path="metadata.name"),
        EnvVar("NONE", field_path="metadata.labels['nope']"),
        EnvVar("REF", value="$(POD)-x"),
    ]
    got = container_env(env, meta, {"s3": {"accesskey": "ak"}})
    assert got == {"A": "ak", "WF": "wf", "POD": "wf-x-123", "NONE": "", "REF": "wf-x-123-x"}
    with pytest.raises(PodPending, match='CreateContainerConfigError: secret "s3" not found'):
        container_env(env, meta, {})
    assert expand("$(POD) $(mktemp -d) $$ $@ $(", {"POD": "p"}) == "p $(mktemp -d) $ $@ $("


def test_label_selectors_as_the_chaos_role_sends_them():
    labels = {"ddiloco.io/role": "learner", "workflows.argoproj.io/workflow": "wf-a"}
    assert selector_matches("ddiloco.io/role in (learner,syncer),workflows.argoproj.io/workflow=wf-a", labels)
    assert not selector_matches("ddiloco.io/role in (syncer),workflows.argoproj.io/workflow=wf-a", labels)
    assert selector_matches("ddiloco.io/role,!other,x notin (y),workflows.argoproj.io/workflow!=wf-b", labels)
    assert Cluster().namespace == "kubeflow"


# --- the API stand-in, through the official client and ddiloco's backend ---------------------------------
class _Pods:
    def __init__(self) -> None:
        mk = {
            "metadata": {"namespace": "ns"},
            "status": {"phase": "Running"},
            "spec": {"containers": [{"name": "main"}]},
        }
        self.pods = {n: json.loads(json.dumps(mk)) for n in ("wf-a-learner", "wf-a-report", "wf-b-learner")}
        for name, pod in self.pods.items():
            pod["metadata"]["name"] = name
            pod["metadata"]["labels"] = {"workflows.argoproj.io/workflow": name[:4]}
            if "learner" in name:
                pod["metadata"]["labels"]["ddiloco.io/role"] = "learner"
        self.deleted: list[tuple[str, float | None]] = []

    def list_pods(self, namespace: str) -> list[dict]:
        return list(self.pods.values()) if namespace == "ns" else []

    def delete_pod(self, namespace: str, name: str, grace_period_s: float | None) -> dict | None:
        self.deleted.append((name, grace_period_s))
        return self.pods.pop(name, None)


def test_kube_api_stand_in_serves_the_official_client_and_the_chaos_backend(tmp_path, monkeypatch):
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    from ddiloco.chaos.k8s import KubernetesPods
    from tests.twin.kubeapi import KubeAPI

    pods, requests = _Pods(), []
    api = KubeAPI(pods, requests.append).start()
    saved = client.Configuration._default
    try:
        kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig", "ns")
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        monkeypatch.setenv("KUBECONFIG", str(kubeconfig))  # a pod gets it in its env, read at import time:
        monkeypatch.setattr("kubernetes.config.kube_config.KUBE_CONFIG_DEFAULT_LOCATION", str(kubeconfig))
        backend = KubernetesPods.connect("ns", "wf-a")  # in-cluster config fails, then the kubeconfig
        assert backend.pods() == {"wf-a-learner": "learner"}
        assert backend.kill("learner", "wf-a-learner", None).action == "deleted pod"
        assert pods.deleted == [("wf-a-learner", 0.0)]
        core = backend.api
        assert core.read_namespaced_pod("wf-a-report", "ns").metadata.name == "wf-a-report"
        with pytest.raises(ApiException) as e:
            core.delete_namespaced_pod("wf-a-learner", "ns", grace_period_seconds=0)
        assert e.value.status == 404
        assert core.list_namespaced_pod("other").items == []
    finally:
        client.Configuration.set_default(saved)
        api.stop()
    assert requests[0]["query"]["labelSelector"] == (
        "ddiloco.io/role in (learner,syncer),workflows.argoproj.io/workflow=wf-a"
    )


# --- retry nodes above DAG templates, DAG phases, exit hooks (dagretry.py) ----------------------------------
def test_the_stock_retry_strategy_reaches_every_dag_template_and_an_error_reruns_it():
    stock = dag_template_strategy(KFP_2_17)
    assert stock == {"limit": "2", "retryPolicy": "OnError"} and dag_template_strategy(None) is None
    # one ParallelFor iteration: the iterations DAG holding the iteration-item DAG, both retry nodes
    r = chain(
        ["wf(0).root(0).learners(0).iteration-iterations(0:0)", ".iteration-item"], ["a", "b"], stock, 0
    )
    assert r.name() == "wf(0).root(0).learners(0).iteration-iterations(0:0)(0).iteration-item(0)"
    seen = []
    for t in range(9):  # every attempt of the body ends Error (its learner's pods deleted past their limit)
        name = r.name()  # of the attempt that just ended
        s = settle(r, "Error", "pod deleted", float(t))
        seen.append((s.action, s.level, r.attempts()))
        if s.action == "done":
            break
    inner, outer = ("retry", 1), ("retry", 0)
    assert [x[:2] for x in seen] == [inner, inner, outer, inner, inner, outer, inner, inner, ("done", -1)]
    assert seen[2][2] == [1, 0] and name.endswith("iterations(0:0)(2).iteration-item(2)")
    assert (s.phase, s.message) == ("Error", "No more retries left") and r.restarts == 8
    # OnError never re-runs a DAG that Failed (a step that exited non-zero), and a success is final
    r = chain(["x"], ["dag"], stock, 0)
    assert settle(r, "Failed", "main: Error (exit code 1)", 1).action == "done" and r.attempts() == [1]
    assert settle(chain(["x"], ["dag"], stock, 0), "Succeeded", "", 1).phase == "Succeeded"
    # plain Argo (no workflowDefaults): no retry node, no "(n)" in the names, the phase passes through
    plain = chain(["wf", ".root"], ["entrypoint", "root"], None, 0)
    assert plain.name() == "wf.root" and settle(plain, "Error", "m", 1).phase == "Error"
    # a backoff in the defaults is waited out, then decided again without counting another attempt
    slow = chain(["x"], ["dag"], {"limit": "1", "retryPolicy": "OnError", "backoff": {"duration": "5"}}, 0)
    assert settle(slow, "Error", "m", 10).until == 15 and slow.waiting == (0, 15)
    assert settle(slow, "", "", 15).action == "retry" and slow.attempts() == [1]


def test_dag_phase_takes_the_first_failing_target_and_a_failed_driver_omits_its_dag():
    # exit-handler-1's driver failed: the group is Omitted, its branch Failed, the root DAG Failed
    assert dag_phase({"exit-handler-1": ("Omitted", [], "Failed")}) == "Failed"
    nodes = {
        "prepare": ("Succeeded", [], None),
        "syncer": ("Error", ["prepare"], None),
        "evaluate": ("Omitted", ["syncer"], None),  # omitted: takes syncer's Error
        "chaos": ("Failed", ["prepare"], None),
        "learners": ("Succeeded", ["prepare"], None),
    }
    assert branch_phases(nodes)["evaluate"] == "Error"
    assert dag_phase(nodes) == "Failed"  # targets chaos, evaluate, learners: chaos comes first
    assert dag_phase({**nodes, "chaos": ("Succeeded", ["prepare"], None)}) == "Error"
    assert dag_phase({"a": ("Succeeded", [], None), "b": ("Skipped", ["a"], None)}) == "Succeeded"
    # Argo runs an exit hook only for a Completed node: not for the Omitted group of a failed driver
    assert [hook_runs(p) for p in ("Succeeded", "Failed", "Error", "Omitted", "Skipped")] == [
        True, True, True, False, False,
    ]  # fmt: skip


def test_empty_dir_mounts_become_a_volume_and_a_bad_size_fails_the_driver():
    """KFP 2.17 driver/k8s.go extendPodSpecPatch EmptyDirMounts: a volume (medium, sizeLimit through
    k8sres.MustParse, which panics on a bad quantity) and the main container's mount."""
    from tests.twin.platform import build_pod_spec

    run = RunContext("id", "name", "name", "2026-01-01T00:00:00Z")

    def pod(size: str) -> PodSpec:
        mount = {"volumeName": "dshm", "mountPath": "/dev/shm", "medium": "Memory", "sizeLimit": size}
        k8s = {"emptyDirMounts": [mount]}
        return build_pod_spec({"image": "img"}, k8s, {}, None, run, "learner", ["x"], False)

    got = pod("4Gi")
    assert got.volumes == [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "4Gi"}}]
    assert got.mounts == [{"name": "dshm", "mountPath": "/dev/shm"}]
    with pytest.raises(ValueError, match="quantities must match"):
        pod("4 GB")
