"""The compiled pipelines: golden files (UPDATE_GOLDEN=1 rewrites them) and the structure a cluster relies on."""

from __future__ import annotations

import os
import re

import pytest
import yaml
from ddiloco.components.images import image_tag
from ddiloco.pipelines.compile import PIPELINES, compile_pipeline, golden_path, stable_header
from ddiloco.pipelines.pretrain import SECRET_KEYS

TAG = re.compile(r"(ddiloco-(?:learner|syncer)):\d+\.\d+\.\d+-[0-9a-f]{12}")


def without_tags(text: str) -> str:
    """The image tags hold a digest of the sources (components/images.py): they change with every code change,
    so the golden files are compared without them (test_images checks the tag itself)."""
    return TAG.sub(r"\1:TAG", text)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    out = tmp_path_factory.mktemp("compiled")
    return {name: compile_pipeline(name, out / f"{name}.yaml") for name in PIPELINES}


@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_golden_file_matches(compiled, name):
    fresh, golden = compiled[name].read_text(), golden_path(name)
    if os.environ.get("UPDATE_GOLDEN") == "1":
        golden.write_text(fresh)
    assert golden.is_file(), f"{golden} is missing: run UPDATE_GOLDEN=1 pytest {__file__}"
    assert TAG.search(golden.read_text()), f"{golden.name} names no VERSION-DIGEST image tag"
    assert without_tags(fresh) == without_tags(golden.read_text()), (
        f"{golden.name} is stale: the pipeline changed. Review the diff, then UPDATE_GOLDEN=1 pytest {__file__}"
    )


def test_header_defaults_are_printed_in_a_stable_order():
    line = "#    tol: list [Default: [{'operator': 'Exists', 'effect': 'NoSchedule', 'key': 'k'}]]"
    assert (
        stable_header(line)
        == "#    tol: list [Default: [{'effect': 'NoSchedule', 'key': 'k', 'operator': 'Exists'}]]"
    )


class Spec:
    """The pipeline IR and its Kubernetes platform spec, looked up by task display name."""

    def __init__(self, path):
        self.ir, self.platform = yaml.safe_load_all(path.read_text())
        self.executors = self.platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
        self.tasks = {}  # display name -> (task, dag it lives in)
        for comp in [self.ir["root"], *self.ir["components"].values()]:
            for key, task in comp.get("dag", {}).get("tasks", {}).items():
                self.tasks[task["taskInfo"]["name"]] = (key, task)

    def deps(self, name):
        return sorted(self.name_of(k) for k in self.tasks[name][1].get("dependentTasks", []))

    def name_of(self, key):
        return next(n for n, (k, _) in self.tasks.items() if k == key)

    def executor(self, name):
        task = self.tasks[name][1]
        label = self.ir["components"][task["componentRef"]["name"]]["executorLabel"]
        return self.ir["deploymentSpec"]["executors"][label]["container"], self.executors.get(label, {})


@pytest.fixture(scope="module")
def pretrain(compiled):
    return Spec(compiled["pretrain"])


def test_learners_syncer_and_chaos_run_side_by_side_after_prepare(pretrain):
    # Data first: tokenize-plan, a ParallelFor of tokenize-unit over its units, tokenize-finish after the
    # whole loop, whose output (the corpus URL) prepare reads.
    assert pretrain.deps("tokenize-plan") == [] and pretrain.deps("prepare") == ["tokenize-finish"]
    assert pretrain.deps("tokenize-finish") == ["tokenize", "tokenize-plan"]
    units = pretrain.tasks["tokenize"][1]
    assert units["parameterIterator"]["items"]["inputParameter"] == "pipelinechannel--tokenize-plan-units"
    assert units["iteratorPolicy"]["parallelismLimit"] == PIPELINES["pretrain"].tokenize_parallelism
    corpus = pretrain.tasks["prepare"][1]["inputs"]["parameters"]["corpus"]["taskOutputParameter"]
    assert corpus == {"producerTask": "tokenize-finish", "outputParameterKey": "Output"}
    for name in ("learners", "syncer", "chaos"):
        assert pretrain.deps(name) == ["prepare"], name
    loop = pretrain.tasks["learners"][1]
    assert loop["iteratorPolicy"]["parallelismLimit"] == PIPELINES["pretrain"].max_learners
    assert loop["parameterIterator"]["items"]["inputParameter"] == "pipelinechannel--prepare-Output"


def test_evaluate_after_the_syncer_then_sft_then_evaluate_then_report_as_the_exit_handler(pretrain):
    assert pretrain.deps("evaluate-final") == ["syncer"]
    assert pretrain.deps("sft") == ["evaluate-final"]
    assert pretrain.deps("evaluate-sft") == ["sft"]
    # The models leave the run as KFP Model artifacts once evaluated (their validation loss in the metadata).
    assert pretrain.deps("export-final") == ["evaluate-final"] and pretrain.deps("export-sft") == [
        "evaluate-sft"
    ]
    for step, output in (("export-final", "final_model"), ("export-sft", "sft_model")):
        comp = pretrain.ir["components"][pretrain.tasks[step][1]["componentRef"]["name"]]
        assert comp["outputDefinitions"]["artifacts"][output]["artifactType"]["schemaTitle"] == "system.Model"
    syncer = pretrain.ir["components"][pretrain.tasks["syncer"][1]["componentRef"]["name"]]
    assert "outputDefinitions" not in syncer  # no pointer artifacts left
    # The report runs however the run ended: KFP's exit handler is a task after the DAG that holds every
    # other step, triggered when that DAG completes in any state (not only on success).
    report = pretrain.tasks["report"][1]
    assert report["triggerPolicy"]["strategy"] == "ALL_UPSTREAM_TASKS_COMPLETED"
    assert pretrain.deps("report") == ["run"]
    inside = pretrain.ir["components"][pretrain.tasks["run"][1]["componentRef"]["name"]]["dag"]["tasks"]
    assert {t["taskInfo"]["name"] for t in inside.values()} >= {"prepare", "learners", "syncer", "sft"}
    inputs = {
        n: pretrain.tasks[n][1]["inputs"]["parameters"]["model"]["runtimeValue"]["constant"]
        for n in ("evaluate-final", "evaluate-sft")
    }
    assert inputs == {"evaluate-final": "final", "evaluate-sft": "sft"}


def _duration_s(text):
    assert text.endswith("s"), text
    return float(text[:-1])


@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_retries_cover_the_whole_run_with_a_constant_integer_backoff(compiled, name):
    """Argo v4.0.5 (workflow/controller/operator.go, processNodeRetries) counts backoff.maxDuration from the
    FIRST attempt's start, refuses a retry whose wait ends after it, and cuts retried pods at that deadline;
    it parses the factor with intstr.Int32, and KFP 2.17 renders the IR's float with Go's %v ("2", "1.5")."""
    spec, opts = Spec(compiled[name]), PIPELINES[name]
    policies = {
        n: t["retryPolicy"] for n, (_, t) in spec.tasks.items() if "componentRef" in t and "retryPolicy" in t
    }
    assert policies, name
    for task, policy in policies.items():
        assert _duration_s(policy["backoffMaxDuration"]) >= opts.run_timeout_s, (task, policy)
        factor = float(policy["backoffFactor"])
        assert factor.is_integer() and factor == 1.0, (task, policy)
        waits = _duration_s(policy["backoffDuration"]) * policy["maxRetryCount"]
        assert waits < opts.run_timeout_s, (task, policy)


def test_retries_and_no_caching(pretrain):
    opts = PIPELINES["pretrain"]
    expected = {"learner": opts.learner_retries, "syncer": opts.syncer_retries, "chaos": opts.step_retries}
    for name, retries in expected.items():
        policy = pretrain.tasks[name][1]["retryPolicy"]
        assert policy["maxRetryCount"] == retries and policy["backoffDuration"] == opts.backoff
    assert opts.learner_retries >= 50
    for name, (_, task) in pretrain.tasks.items():
        if "componentRef" in task and name not in ("learners", "tokenize", "run"):  # not the loops
            assert task["cachingOptions"] == {}, (
                f"{name} must not be cached (enableCache false is the empty message)"
            )


PLACEHOLDER = re.compile(r"\{\{\$\.pipeline_[a-z_]+\}\}")


@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_no_runtime_constant_embeds_a_pipeline_placeholder(compiled, name):
    """KFP 2.17's driver replaces `{{$.pipeline_job_uuid}}` and its kin only when a constant IS the placeholder
    (backend/src/v2/driver/resolve.go, resolveInputParameter: `switch valStr`), and the launcher's placeholder
    map (launcher_v2.go, getPlaceholders) has no such key: embedded, it reaches the component literally."""
    spec = Spec(compiled[name])
    found = []
    for task_name, (_, task) in spec.tasks.items():
        for param, value in task.get("inputs", {}).get("parameters", {}).items():
            const = value.get("runtimeValue", {}).get("constant")
            if isinstance(const, str) and PLACEHOLDER.search(const) and not PLACEHOLDER.fullmatch(const):
                found.append((task_name, param, const))
    assert not found, f"embedded pipeline placeholders (never resolved on a real cluster): {found}"


@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_learners_and_syncer_export_their_pod_name_and_namespace(compiled, name):
    """The kubelet truncates hostnames to 63 characters; Argo v4's pod names for our tasks are longer. The
    chaos step finds a pod by the name its process reports, so that name is the downward API's."""
    spec = Spec(compiled[name])
    roles = ("learner", "syncer") if name != "join" else ("learner",)
    for role in roles:
        _, k8s = spec.executor(role)
        env = {e["name"]: e["fieldPath"] for e in k8s["fieldPathAsEnv"]}
        assert env["DDILOCO_POD_NAME"] == "metadata.name", (name, role)
        assert env["DDILOCO_K8S_NAMESPACE"] == "metadata.namespace", (name, role)


# pipelines-profile-controller/sync.py (KFP 2.17): what a profile namespace's store identity may write.
PROFILE_WRITABLE = ("artifacts/", "private-artifacts/{namespace}/", "private/{namespace}/", "shared/")


@pytest.mark.parametrize("name", ["pretrain", "smoke"])
def test_defaults_need_no_vendor_labels_and_write_where_a_profile_may(compiled, name):
    params = Spec(compiled[name]).ir["root"]["inputDefinitions"]["parameters"]
    defaults = {k: v.get("defaultValue") for k, v in params.items()}
    assert defaults["gpu_node_selector"] == {} and defaults["cpu_node_selector"] == {}
    assert defaults["store_prefix"].startswith(PROFILE_WRITABLE), defaults["store_prefix"]
    assert defaults["store_bucket"] == "mlpipeline"


def test_cluster_settings_are_empty_by_default_and_reach_both_keepers(pretrain):
    """`kueue_queue` and `pod_settings` (components/podsettings.py): run-time parameters, empty by default,
    passed to the learner and syncer keepers, which put them on the pods they create."""
    params = pretrain.ir["root"]["inputDefinitions"]["parameters"]
    assert params["kueue_queue"]["defaultValue"] == "" and params["pod_settings"]["defaultValue"] == {}
    for name in ("learner", "syncer"):
        _, task = _worker(pretrain, name)
        for key in ("kueue_queue", "pod_settings"):
            assert task[key]["componentInputParameter"].endswith(key), (name, key)


@pytest.fixture(scope="module")
def direct(tmp_path_factory):
    """pretrain with `keeper=False`: the roles in their task pods (`ddiloco pipeline compile --no-keeper`)."""
    return Spec(compile_pipeline("pretrain", tmp_path_factory.mktemp("direct") / "p.yaml", keeper=False))


def _worker(spec, name):
    task = spec.tasks[name][1]
    return task["inputs"]["parameters"]["worker"]["runtimeValue"]["constant"], task["inputs"]["parameters"]


def test_keepers_are_tiny_guaranteed_cpu_tasks_that_give_their_workers_the_roles_pod(pretrain):
    """The keeper's own pod: requests == limits, no GPU, CPU nodes, the keeper label (not the role label the
    chaos step selects on); its worker: the GPU image, resources, pool and tolerations the task had."""
    for name, role in (("learner", "learner"), ("syncer", "syncer")):
        container, k8s = pretrain.executor(name)
        res = container["resources"]
        assert container["image"] == f"ghcr.io/ddiloco/ddiloco-syncer:{image_tag()}"
        assert "accelerator" not in res
        assert res["resourceCpuLimit"] == res["resourceCpuRequest"] == PIPELINES["pretrain"].keeper_cpu
        assert (
            res["resourceMemoryLimit"] == res["resourceMemoryRequest"] == PIPELINES["pretrain"].keeper_memory
        )
        assert k8s["podMetadata"]["labels"]["ddiloco.io/keeper"] == role
        assert "ddiloco.io/role" not in k8s["podMetadata"]["labels"] and "tolerations" not in k8s
        assert k8s["nodeSelector"]["nodeSelectorJson"]["componentInputParameter"].endswith(
            "cpu_node_selector"
        )
        assert int(k8s["activeDeadlineSeconds"]) == PIPELINES["pretrain"].run_timeout_s
        env = {e["name"]: e["fieldPath"] for e in k8s["fieldPathAsEnv"]}
        assert env["DDILOCO_POD_NAME"] == "metadata.name"  # the keeper reads its own pod by this name
    worker, params = _worker(pretrain, "learner")
    assert worker["image"] == f"ghcr.io/ddiloco/ddiloco-learner:{image_tag()}"
    assert worker["limits"] == {"nvidia.com/gpu": "1"} and worker["requests"] == {
        "cpu": "4",
        "memory": "32Gi",
    }
    assert worker["infra_restarts"] == PIPELINES["pretrain"].learner_retries
    assert params["node_selector"]["componentInputParameter"].endswith("gpu_node_selector")
    assert params["tolerations"]["componentInputParameter"].endswith("gpu_tolerations")
    assert params["store_secret"]["componentInputParameter"].endswith("store_secret")
    worker, params = _worker(pretrain, "syncer")
    assert worker["image"] == f"ghcr.io/ddiloco/ddiloco-syncer:{image_tag()}" and worker["limits"] == {}
    assert params["node_selector"]["componentInputParameter"].endswith("cpu_node_selector")


def test_gpus_pools_labels_and_deadlines(pretrain, direct):
    learner, learner_k8s = direct.executor("learner")
    assert learner["image"] == f"ghcr.io/ddiloco/ddiloco-learner:{image_tag()}"
    assert learner["resources"]["accelerator"]["resourceType"] == "nvidia.com/gpu"
    assert learner["resources"]["accelerator"]["resourceCount"] == "1"
    assert learner_k8s["nodeSelector"]["nodeSelectorJson"]["componentInputParameter"].endswith(
        "gpu_node_selector"
    )
    assert learner_k8s["tolerations"][0]["tolerationJson"]["componentInputParameter"].endswith(
        "gpu_tolerations"
    )
    assert learner_k8s["podMetadata"]["labels"]["ddiloco.io/role"] == "learner"
    assert int(learner_k8s["activeDeadlineSeconds"]) == PIPELINES["pretrain"].run_timeout_s

    syncer, syncer_k8s = direct.executor("syncer")
    assert syncer["image"] == f"ghcr.io/ddiloco/ddiloco-syncer:{image_tag()}"
    assert "accelerator" not in syncer.get("resources", {}) and "tolerations" not in syncer_k8s
    assert syncer_k8s["nodeSelector"]["nodeSelectorJson"]["componentInputParameter"].endswith(
        "cpu_node_selector"
    )
    assert syncer_k8s["podMetadata"]["labels"]["ddiloco.io/role"] == "syncer"
    for name in ("evaluate-final", "sft", "evaluate-sft"):
        assert pretrain.executor(name)[0]["resources"]["accelerator"]["resourceType"] == "nvidia.com/gpu"

    _, chaos_k8s = pretrain.executor("chaos")
    env = {e["name"]: e["fieldPath"] for e in chaos_k8s["fieldPathAsEnv"]}
    assert env["DDILOCO_K8S_WORKFLOW"] == "metadata.labels['workflows.argoproj.io/workflow']"
    assert env["DDILOCO_K8S_NAMESPACE"] == "metadata.namespace"


def test_store_credentials_come_from_the_secret_as_env(pretrain):
    for name in ("prepare", "learner", "syncer", "chaos", "evaluate-final", "sft", "evaluate-sft", "report"):
        params = pretrain.tasks[name][1]["inputs"]["parameters"]
        store = params["store"]["runtimeValue"]["constant"]
        assert store == (
            "s3://{{$.inputs.parameters['pipelinechannel--store_bucket']}}/"
            "{{$.inputs.parameters['pipelinechannel--store_prefix']}}"
        ), name
        assert params["run_id"]["runtimeValue"]["constant"] == "{{$.pipeline_job_uuid}}", name
    for name in ("prepare", "learner", "syncer", "chaos", "evaluate-final", "sft", "evaluate-sft", "report"):
        _, k8s = pretrain.executor(name)
        secret, *run_key = k8s["secretAsEnv"]
        assert secret["secretNameParameter"]["componentInputParameter"].endswith("store_secret"), name
        assert {kv["secretKey"]: kv["envVar"] for kv in secret["keyToEnv"]} == SECRET_KEYS
        # Optional: without the Secret (web identity, no static keys: EKS IRSA / Pod Identity) the store takes
        # the AWS credential chain, or fails in one line naming every source it tried (s3_credentials.py).
        assert secret["optional"] is True, name
        if name in ("learner", "syncer"):  # keepers: they sign and read nothing, their workers hold the key
            assert run_key == [], name
            continue
        # The master key signs globals; an optional Secret, so a cluster without it runs unsigned.
        assert run_key[0]["secretName"] == "ddiloco-run-key" and run_key[0]["optional"] is True, name
        assert run_key[0]["keyToEnv"] == [{"envVar": "DDILOCO_RUN_KEY", "secretKey": "key"}]
    defaults = {
        k: v.get("defaultValue") for k, v in pretrain.ir["root"]["inputDefinitions"]["parameters"].items()
    }
    assert defaults["store_secret"] == "mlpipeline-minio-artifact"
    assert defaults["s3_endpoint"] == "seaweedfs.kubeflow:9000"


def test_smoke_pipeline_needs_no_gpu(compiled):
    smoke = Spec(compiled["smoke"])
    for name in ("prepare", "learner", "syncer", "chaos", "evaluate-final", "sft", "evaluate-sft", "report"):
        container, k8s = smoke.executor(name)
        assert "accelerator" not in container.get("resources", {}), name
        assert "tolerations" not in k8s and container["image"].rsplit("/", 1)[1].startswith("ddiloco-syncer:")
    assert smoke.deps("learners") == ["prepare"] and smoke.deps("evaluate-final") == ["syncer"]


def test_compile_options_change_parallelism_and_images(tmp_path):
    from ddiloco.pipelines.cli import main

    out = tmp_path / "p.yaml"
    assert (
        main(
            [
                "pipeline",
                "compile",
                "--out",
                str(out),
                "--max-learners",
                "16",
                "--registry",
                "r.example/team/",
            ]
        )
        == 0
    )
    spec = Spec(out)
    assert spec.tasks["learners"][1]["iteratorPolicy"]["parallelismLimit"] == 16
    assert _worker(spec, "learner")[0]["image"] == f"r.example/team/ddiloco-learner:{image_tag()}"
    assert main(["pipeline", "compile", "--out", str(out), "--no-keeper"]) == 0
    assert Spec(out).executor("learner")[0]["image"] == f"ghcr.io/ddiloco/ddiloco-learner:{image_tag()}"


def test_learner_nodes_give_each_learners_keeper_a_trainjob_of_that_many_nodes(pretrain, tmp_path):
    """`--learner-nodes 2 --gpus-per-learner 4`: the learner keeper's worker says 2 nodes of 4 ranks (the
    keeper then creates a TrainJob, components/trainjob.py); the syncer's and the default's say nothing."""
    from ddiloco.pipelines.cli import main

    out = tmp_path / "p.yaml"
    assert (
        main(["pipeline", "compile", "--out", str(out), "--learner-nodes", "2", "--gpus-per-learner", "4"])
        == 0
    )
    spec = Spec(out)
    worker, _ = _worker(spec, "learner")
    assert (worker["nodes"], worker["procs_per_node"], worker["limits"]) == (2, 4, {"nvidia.com/gpu": "4"})
    assert "ranks" not in worker  # torchrun starts each node's ranks, not --local-ranks
    assert spec.tasks["prepare"][1]["inputs"]["parameters"]["learner_ranks"]["runtimeValue"]["constant"] == 8
    assert "nodes" not in _worker(Spec(out), "syncer")[0] and "nodes" not in _worker(pretrain, "learner")[0]
    with pytest.raises(ValueError, match="drop --no-keeper"):
        compile_pipeline("pretrain", tmp_path / "q.yaml", learner_nodes=2, keeper=False)
    with pytest.raises(ValueError, match="learner_nodes=0"):
        compile_pipeline("pretrain", tmp_path / "q.yaml", learner_nodes=0)


def test_join_pipeline_checks_the_run_then_starts_learners_with_their_site(compiled):
    join = Spec(compiled["join"])
    assert join.deps("check-run") == []
    loop = join.tasks["learners"][1]
    assert join.deps("learners") == ["check-run"]
    assert loop["iteratorPolicy"]["parallelismLimit"] == PIPELINES["join"].max_learners
    params = join.ir["root"]["inputDefinitions"]["parameters"]
    assert {"run_root", "site", "learners", "store_secret", "s3_endpoint", "link_bandwidth"} <= set(params)
    container, k8s = join.executor("learner")
    assert "joiner" in container["args"] and container["image"].endswith(f":{image_tag()}")
    assert any(
        e["secretNameParameter"]["componentInputParameter"].endswith("store_secret")
        for e in k8s["secretAsEnv"]
    )
    assert k8s["podMetadata"]["labels"]["ddiloco.io/role"] == "learner"


def test_a_learner_pod_starts_one_rank_per_gpu(tmp_path, pretrain):
    """`--gpus-per-learner 4`: the learner's worker (keeper) or task (direct) starts 4 ranks
    (`ddiloco learner --local-ranks 4`) and prepare sets train.ranks=4, so the syncer bounds an answer's
    tokens by 4 ranks' batches; one GPU (the golden YAML) starts one process."""
    from ddiloco.components.runtime import command, prepare_settings
    from ddiloco.pipelines.pretrain import ClusterOptions

    four = Spec(compile_pipeline("pretrain", tmp_path / "k.yaml", gpus_per_learner=4))
    worker, _ = _worker(four, "learner")
    assert worker["ranks"] == 4 and worker["limits"] == {"nvidia.com/gpu": "4"}
    assert four.tasks["prepare"][1]["inputs"]["parameters"]["learner_ranks"]["runtimeValue"]["constant"] == 4
    direct = Spec(compile_pipeline("pretrain", tmp_path / "d.yaml", gpus_per_learner=4, keeper=False))
    assert direct.tasks["learner"][1]["inputs"]["parameters"]["local_ranks"]["runtimeValue"]["constant"] == 4
    assert "ranks" not in _worker(pretrain, "learner")[0]
    assert ClusterOptions(gpus_per_learner=4, gpu=False).learner_ranks == 1  # CPU nodes: one process
    given = {"overrides": ["train.ranks=8"], "learners": 2, "max_learners": 8, "learner_ranks": 4}
    assert prepare_settings(given)[:3] == [
        "diloco.max_learners=8",
        "train.ranks=4",
        "train.ranks=8",  # an override given in the UI wins
    ]
    assert command("learner", local_ranks=4)[-2:] == ["--local-ranks", "4"]


def test_gpu_learner_pods_get_a_memory_backed_dev_shm(tmp_path, pretrain, direct):
    """NCCL's shared memory outgrows a pod's default 64 MiB /dev/shm with several GPUs (kubeflow/trainer
    docs/user-guides/megatron.md): the learner's worker (keeper) and its task pod (direct, KFP 2.17 driver
    k8s.go EmptyDirMounts) get a memory-backed emptyDir there; the syncer and CPU-only learners do not."""
    from ddiloco.pipelines.pretrain import ClusterOptions

    size = ClusterOptions().learner_shm
    assert _worker(pretrain, "learner")[0]["shm"] == size == "4Gi"
    assert "shm" not in _worker(pretrain, "syncer")[0]
    (mount,) = direct.executor("learner")[1]["emptyDirMounts"]
    assert mount == {"volumeName": "dshm", "mountPath": "/dev/shm", "medium": "Memory", "sizeLimit": size}
    assert "emptyDirMounts" not in direct.executor("syncer")[1]
    cpu = Spec(compile_pipeline("pretrain", tmp_path / "cpu.yaml", gpu=False))
    assert "shm" not in _worker(cpu, "learner")[0]
    none = Spec(compile_pipeline("pretrain", tmp_path / "none.yaml", learner_shm="", keeper=False))
    assert "emptyDirMounts" not in none.executor("learner")[1]
    with pytest.raises(ValueError, match="learner_shm '4 GB': write a Kubernetes quantity like 4Gi"):
        compile_pipeline("pretrain", tmp_path / "bad.yaml", learner_shm="4 GB")  # the driver would panic


def test_learner_pods_get_a_learners_share_of_the_run_key_never_the_master_key(pretrain, direct):
    """Keys per role (issue 49): a learner's worker (and, with `--no-keeper`, its task pod) maps the learner
    Secret's `learner` and `syncer_pub` entries; the syncer's the master key; keepers nothing."""
    share = {"learner": "DDILOCO_LEARNER_KEY", "syncer_pub": "DDILOCO_SYNCER_PUBKEY"}
    worker, _ = _worker(pretrain, "learner")
    assert worker["run_key"] == {"secret": "ddiloco-learner-key", "entries": share}
    worker, _ = _worker(pretrain, "syncer")
    assert worker["run_key"] == {"secret": "ddiloco-run-key", "entries": {"key": "DDILOCO_RUN_KEY"}}
    _, k8s = direct.executor("learner")
    (run_key,) = [s for s in k8s["secretAsEnv"] if s.get("secretName") == "ddiloco-learner-key"]
    assert {kv["secretKey"]: kv["envVar"] for kv in run_key["keyToEnv"]} == share
    assert not any(s.get("secretName") == "ddiloco-run-key" for s in k8s["secretAsEnv"])
    _, k8s = direct.executor("syncer")
    assert any(s.get("secretName") == "ddiloco-run-key" for s in k8s["secretAsEnv"])
