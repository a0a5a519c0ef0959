"""The `pretrain` pipeline: tokenize (plan → units ∥ → finish) → prepare → [learners ∥ syncer ∥ chaos] →
evaluate → [sft → evaluate → export ∥ export] → report.

Run-time parameters (`ddiloco.components.params`) are what a person turns in the KFP UI; compile-time
`ClusterOptions` are what a platform engineer fixes once per cluster. Learners are a ParallelFor over the ids
`prepare` returns, all at once, on the GPU pool; the syncer and the chaos step are siblings on CPU nodes. The
run root is `s3://{bucket}/{prefix}/{KFP run id}`. A text corpus is tokenized into the store by a ParallelFor.
The models leave the run as KFP Model artifacts, and the report is the exit handler, so failed runs get one
too. Caching is off (every step writes the store). Stock KFP retries no pod Argo marks Failed, so learners and
the syncer run under keepers that restart their worker pods (`ddiloco.components.keeper`), and every step is
safe to re-run.

Design notes (settings, data, retries, naming): docs/internals.md, "The pretrain pipeline".
"""

import functools
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ddiloco.components import params
from ddiloco.components.images import DEFAULT_REGISTRY, LEARNER, SYNCER, image
from ddiloco.components.keeper import KEEPER_LABEL, SHM_MEDIUM, SHM_PATH, SHM_VOLUME
from ddiloco.components.roles import Components, build
from ddiloco.components.runtime import NAMESPACE_ENV
from kfp import dsl, kubernetes

from ddiloco.chaos.k8s import DEFAULT_SELECTOR, ROLE_LABEL
from ddiloco.platform.hostname import POD_NAME_ENV

RUN_KEY_ENV = "DDILOCO_RUN_KEY"  # ddiloco.protocol.signing.ENV_VAR (pipelines import no torch-heavy modules)
LEARNER_KEY_ENVS = {"learner": "DDILOCO_LEARNER_KEY", "syncer_pub": "DDILOCO_SYNCER_PUBKEY"}
"""The learner Secret's entries -> the variables a learner reads (`signing.LEARNER_KEY_VAR`, `SYNCER_PUBKEY_VAR`)."""
SECRET_KEYS = {"accesskey": "DDILOCO_S3_ACCESS_KEY", "secretkey": "DDILOCO_S3_SECRET_KEY"}
"""Keys of KFP's artifact-store Secret -> the variables `ddiloco.store.s3` reads."""
WORKFLOW_LABEL_PATH = "metadata.labels['workflows.argoproj.io/workflow']"
QUANTITY = re.compile(r"(\d+(\.\d+)?|\.\d+)([KMGTPE]i|[kMGTPE])?")
"""A plain Kubernetes memory quantity (apimachinery resource.ParseQuantity accepts these, and more)."""


@dataclass(frozen=True, kw_only=True)
class ClusterOptions:
    """Compile-time settings of a pipeline (one compiled YAML per cluster setup)."""

    name: str = "ddiloco-pretrain"
    description: str = (
        "Decoupled DiLoCo pre-training: M learners and a syncer over object storage, chaos, eval, SFT."
    )
    registry: str = DEFAULT_REGISTRY
    """Image registry: images are {registry}/ddiloco-learner|syncer:{package version}."""
    gpu: bool = True
    """Learners, evaluation and SFT request GPUs on the CUDA image; False runs everything on CPU nodes."""
    max_learners: int = 8
    """ParallelFor parallelism: the most learners one run may have (all of them run at once); `prepare` cuts
    one data shard per learner id below it (`diloco.max_learners`), so learners that join read their own."""
    accelerator: str = "nvidia.com/gpu"
    """Extended resource a GPU step requests."""
    gpus_per_learner: int = 1
    """GPUs per learner pod, or per node of a multi-node learner: one rank per GPU (`ddiloco learner
    --local-ranks`, or torchrun on each node of a multi-node learner; its ranks per node on CPU too), DDP
    or FSDP2 by `train.parallel`."""
    learner_nodes: int = 1
    """Nodes (pods) per learner. Above 1 each learner is a Kubeflow Trainer TrainJob (`torch-distributed`
    runtime) of this many pods, `gpus_per_learner` ranks each, under torchrun, which its keeper creates
    and restarts as a whole (`ddiloco.components.trainjob`); needs `keeper` and Kubeflow Trainer. Prepare
    sets `train.ranks` to learner_nodes × gpus_per_learner (`learner_ranks`)."""
    learner_cpu: str = "4"
    learner_memory: str = "32Gi"
    learner_shm: str = "4Gi"
    """Size limit of a GPU learner pod's memory-backed /dev/shm (NCCL's shared memory; a pod gets 64 MiB
    otherwise: `ddiloco.components.keeper.shm_volume`); used pages count against the pod's memory. Empty:
    none."""
    syncer_cpu: str = "4"
    """The syncer merges fragments in fp32 on CPU: give it cores and memory for ~3 copies of the model."""
    syncer_memory: str = "16Gi"
    learner_retries: int = 100
    """Retries per learner: of its keeper pod (Argo), and new worker incarnations after the cluster took one
    away (the keeper); each comes back from its checkpoint in the store."""
    syncer_retries: int = 20
    tokenize_parallelism: int = 16
    """Input files tokenized at once (one pod each) when a run gives `text_corpus`."""
    step_retries: int = 3
    """Retries of prepare, chaos, evaluate, sft and report."""
    backoff: str = "10s"
    """Wait before each retry of a deleted or failed pod (constant: factor 1)."""
    crash_restarts: int = 5
    """Restarts of a crashed learner / syncer: new worker pods from its keeper, or inside its task pod with
    `keeper=False` (Argo retries deleted pods, not crashes)."""
    run_timeout_s: int = 3 * 24 * 3600
    """Deadline of each learner / syncer / chaos pod, and the window in which any step is retried."""
    run_key_secret: str | None = "ddiloco-run-key"
    learner_key_secret: str = "ddiloco-learner-key"
    """Secret (keys `learner`, `syncer_pub`: `ddiloco keys` prints them) mounted optionally in learner pods
    instead of the master key: learners sign answers and verify what the syncer signs, but cannot sign as
    it (`ddiloco.protocol.rolekeys`). Used when `run_key_secret` is set."""
    """Secret (key `key`: hex, `openssl rand -hex 32`) mounted optionally as DDILOCO_RUN_KEY: every update and
    global version is then signed and verified. A missing Secret leaves the run unsigned (logged); None: never.
    Learner pods never get it: they get `learner_key_secret`."""
    keeper: bool = True
    """Learners and the syncer run in worker pods a small CPU keeper task starts and restarts through the
    Kubernetes API (`ddiloco.components.keeper`): they survive preemption, eviction, OOM kills, drains and
    admission errors on stock KFP 2.17. False runs them in the task pod itself (a cluster with
    `manifests/argo-retry`, which makes Argo retry those pods)."""
    keeper_cpu: str = "100m"
    keeper_memory: str = "256Mi"
    """A keeper's requests == limits (Guaranteed QoS where Argo's executor containers are too)."""
    keeper_poll_s: float = 2.0
    """Seconds between two looks of a keeper at its worker."""
    metrics_port: int = 9400
    """Port of the learners' and syncer's Prometheus /metrics (`--metrics-port`; manifests/monitoring scrapes it)."""
    defaults: dict[str, Any] = field(default_factory=dict)
    """Run-time parameter defaults, over those of the parameters' table (`ddiloco.components.params`)."""

    @property
    def learner_pod_shm(self) -> str:
        """The /dev/shm size of a learner pod: `learner_shm` on GPU nodes, none on CPU ones."""
        return self.learner_shm if self.gpu else ""

    @property
    def learner_ranks(self) -> int:
        """Ranks of one learner: one per GPU of each of its nodes (a single-node learner on CPU: 1)."""
        if self.learner_nodes > 1:
            return self.learner_nodes * self.gpus_per_learner
        return self.gpus_per_learner if self.gpu else 1


RUN_ID = dsl.PIPELINE_JOB_ID_PLACEHOLDER
"""Always passed as a parameter's whole value: the only form the KFP 2.17 driver replaces."""


def duration_s(text: str) -> float:
    """A Go duration of one unit ("10s", "2m", "1h") in seconds."""
    units = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
    for unit in sorted(units, key=len, reverse=True):
        if text.endswith(unit) and text[: -len(unit)].replace(".", "", 1).isdigit():
            return float(text[: -len(unit)]) * units[unit]
    raise ValueError(f"backoff {text!r}: write a duration like 10s, 2m or 1h")


def run_defaults(table: Sequence[params.Param], opts: ClusterOptions) -> dict[str, Any]:
    """A pipeline's run-time parameter defaults: the table's with the options' over them, learners within the
    options."""
    unknown = sorted(set(opts.defaults) - {p.name for p in table})
    if unknown:
        raise ValueError(f"defaults for {unknown}: {opts.name} has no such run parameter")
    d = {**params.defaults(table), **opts.defaults}
    if not 1 <= d["learners"] <= opts.max_learners:
        raise ValueError(
            f"default learners={d['learners']} must be within 1..max_learners={opts.max_learners}"
        )
    return d


def task(
    c: Components, table: Sequence[params.Param], values: dict[str, Any], name: str, **given: Any
) -> Any:
    """A task of component `name`: the arguments `given`, and the run parameters whose rows send it theirs."""
    component, sent = getattr(c, name), params.arguments(table, values, name)
    missing = sorted(set(sent) - set(component.component_spec.inputs or {}))
    if missing:
        raise ValueError(
            f"the run parameters' table sends step {name!r} inputs {missing} it does not have: add them to "
            "the signature of its function (components/roles.py, components/keepers.py)"
        )
    return component(**given, **sent)


def pipeline_function(opts: ClusterOptions = ClusterOptions()) -> Callable[..., Any]:
    """The `@dsl.pipeline` function for these options (compile it with `kfp.compiler.Compiler`): one parameter
    per row of `ddiloco.components.params.PRETRAIN`, each passed by name to the steps its row names."""
    table = params.PRETRAIN
    d = run_defaults(table, opts)
    if opts.learner_shm and not QUANTITY.fullmatch(opts.learner_shm):  # the driver's MustParse would panic
        raise ValueError(f"learner_shm {opts.learner_shm!r}: write a Kubernetes quantity like 4Gi or 512Mi")
    if opts.learner_nodes < 1 or (opts.learner_nodes > 1 and not opts.keeper):
        raise ValueError(
            f"learner_nodes={opts.learner_nodes}: give 1, or more with keepers (a TrainJob is created by a "
            "learner's keeper; drop --no-keeper)"
        )
    c = build(opts.registry, gpu=opts.gpu)

    def pretrain(p: dict[str, Any]) -> None:
        step = functools.partial(task, c, table, p)
        store = f"s3://{p['store_bucket']}/{p['store_prefix']}"
        placement = p["gpu_node_selector"], p["gpu_tolerations"], p["cpu_node_selector"]
        gpu_selector, tolerations, cpu_selector = placement
        k8s = _Wiring(opts, p["store_secret"], *placement)
        report = k8s.cpu_step(step("report", store=store, run_id=RUN_ID), "report")
        with dsl.ExitHandler(report, name="run"):
            limits = {"max_learners": opts.max_learners, "learner_ranks": opts.learner_ranks}
            plan = k8s.cpu_step(step("tokenize_plan", store=store, **limits), "tokenize-plan")
            units = plan.outputs["units"]
            with dsl.ParallelFor(items=units, parallelism=opts.tokenize_parallelism, name="tokenize") as unit:
                one = step("tokenize_unit", corpus=plan.outputs["corpus"], unit=unit)
                k8s.cpu_step(one, "tokenize-unit")
            tok = step("tokenize_finish", corpus=plan.outputs["corpus"], tokenized=plan.outputs["tokenized"])
            k8s.cpu_step(tok.after(one), "tokenize-finish")
            prep = step("prepare", store=store, run_id=RUN_ID, corpus=tok.output, **limits)
            k8s.cpu_step(prep, "prepare")
            roles = {"store": store, "run_id": RUN_ID}
            roles.update(metrics_port=opts.metrics_port, restarts=opts.crash_restarts)
            with dsl.ParallelFor(items=prep.output, parallelism=opts.max_learners, name="learners") as lid:
                if opts.keeper:
                    learner = step(
                        "learner_keeper",
                        learner_id=lid,
                        worker=k8s.worker("learner"),
                        node_selector=gpu_selector if opts.gpu else cpu_selector,
                        tolerations=tolerations if opts.gpu else [],
                        **roles,
                    )
                    k8s.keeper(learner.after(prep), "learner", opts.learner_retries)
                else:
                    ranks = {"local_ranks": opts.learner_ranks} if opts.learner_ranks > 1 else {}
                    k8s.learner(step("learner", learner_id=lid, **roles, **ranks).after(prep))
            if opts.keeper:
                sync = step("syncer_keeper", worker=k8s.worker("syncer"), node_selector=cpu_selector, **roles)
                sync = k8s.keeper(sync.after(prep), "syncer", opts.syncer_retries)
            else:
                sync = k8s.syncer(step("syncer", **roles).after(prep))
            k8s.chaos(step("chaos", store=store, run_id=RUN_ID, selector=DEFAULT_SELECTOR).after(prep))
            common = {"store": store, "run_id": RUN_ID}
            pre = k8s.gpu_step(step("evaluate", model="final", **common).after(sync), "evaluate-final")
            k8s.cpu_step(step("export_final", **common).after(pre), "export-final")
            tune = k8s.gpu_step(step("sft", **common).after(pre), "sft")
            post = k8s.gpu_step(step("evaluate", model="sft", **common).after(tune), "evaluate-sft")
            k8s.cpu_step(step("export_sft", **common).after(post), "export-sft")

    return dsl.pipeline(name=opts.name, description=opts.description)(
        params.pipeline_func("pretrain", table, d, pretrain)
    )


@dataclass
class _Wiring:
    """Kubernetes settings of each kind of step (resources, pools, labels, secrets, retries, deadlines)."""

    opts: ClusterOptions
    secret: Any
    gpu_selector: Any
    gpu_tolerations: Any
    cpu_selector: Any

    def _run_key(self, role: str | None) -> tuple[str, dict[str, str]]:
        """The Secret and entries -> variables a pod of `role` gets: a learner's share, else the master key."""
        if role == "learner":
            return self.opts.learner_key_secret, dict(LEARNER_KEY_ENVS)
        assert self.opts.run_key_secret is not None
        return self.opts.run_key_secret, {"key": RUN_KEY_ENV}

    def _common(
        self, task: Any, name: str, retries: int, role: str | None = None, run_key: bool = True
    ) -> Any:
        """What every task gets; `run_key`: the role's share of the run key (`_run_key`; a keeper, which
        signs and reads nothing, gets none)."""
        o = self.opts
        task.set_display_name(name).set_caching_options(False)
        task.set_retry(
            num_retries=retries,
            backoff_duration=o.backoff,
            backoff_factor=1.0,
            backoff_max_duration=f"{o.run_timeout_s}s",
        )
        # Optional: without the Secret (a cluster with web identity, no static keys) the store takes the AWS
        # credential chain (ddiloco/store/s3_credentials.py), or fails in one line naming what it tried.
        kubernetes.use_secret_as_env(
            task, secret_name=self.secret, secret_key_to_env=SECRET_KEYS, optional=True
        )
        kubernetes.use_field_path_as_env(task, NAMESPACE_ENV, "metadata.namespace")
        kubernetes.use_field_path_as_env(task, POD_NAME_ENV, "metadata.name")
        if o.run_key_secret and run_key:
            secret, entries = self._run_key(role)
            kubernetes.use_secret_as_env(task, secret_name=secret, secret_key_to_env=entries, optional=True)
        kubernetes.add_pod_label(task, "app.kubernetes.io/part-of", "ddiloco")
        if role is not None:
            kubernetes.add_pod_label(task, ROLE_LABEL, role)
        return task

    def _on_gpus(self, task: Any, gpus: int) -> Any:
        if self.opts.gpu:
            task.set_accelerator_type(self.opts.accelerator).set_accelerator_limit(gpus)
            kubernetes.add_node_selector_json(task, self.gpu_selector)
            kubernetes.add_toleration_json(task, self.gpu_tolerations)
        else:
            kubernetes.add_node_selector_json(task, self.cpu_selector)
        return task

    def cpu_step(
        self, task: Any, name: str, retries: int | None = None, role: str | None = None, run_key: bool = True
    ) -> Any:
        kubernetes.add_node_selector_json(task, self.cpu_selector)
        return self._common(task, name, self.opts.step_retries if retries is None else retries, role, run_key)

    def gpu_step(self, task: Any, name: str) -> Any:
        return self._on_gpus(self._common(task, name, self.opts.step_retries), 1)

    def learner(self, task: Any) -> Any:
        o = self.opts
        self._common(task, "learner", o.learner_retries, role="learner")
        self._on_gpus(task, o.gpus_per_learner)
        if o.learner_pod_shm:  # the worker pod's /dev/shm (`keeper.shm_volume`), on the task pod itself
            kubernetes.empty_dir_mount(
                task, SHM_VOLUME, SHM_PATH, medium=SHM_MEDIUM, size_limit=o.learner_pod_shm
            )
        task.set_cpu_request(o.learner_cpu).set_memory_request(o.learner_memory)
        kubernetes.set_timeout(task, o.run_timeout_s)
        return task

    def syncer(self, task: Any) -> Any:
        o = self.opts
        self.cpu_step(task, "syncer", o.syncer_retries, role="syncer")
        task.set_cpu_request(o.syncer_cpu).set_memory_request(o.syncer_memory)
        kubernetes.set_timeout(task, o.run_timeout_s)
        return task

    def keeper(self, task: Any, role: str, retries: int) -> Any:
        """A keeper task: tiny, requests == limits, CPU nodes, labelled as the keeper of `role` (not with the
        role label: the chaos step kills workers)."""
        o = self.opts
        self.cpu_step(task, role, retries, run_key=False)  # its workers get the key, not the keeper
        kubernetes.add_pod_label(task, KEEPER_LABEL, role)
        task.set_cpu_request(o.keeper_cpu).set_cpu_limit(o.keeper_cpu)
        task.set_memory_request(o.keeper_memory).set_memory_limit(o.keeper_memory)
        kubernetes.set_timeout(task, o.run_timeout_s)
        return task

    def worker(self, role: str) -> dict[str, Any]:
        """The compile-time part of a worker pod (keeper_loop.keep_role): image, resources, restart limits."""
        o = self.opts
        if role == "learner":
            img, limits = image(LEARNER if o.gpu else SYNCER, o.registry), {}
            requests = {"cpu": o.learner_cpu, "memory": o.learner_memory}
            if o.gpu:
                limits = {o.accelerator: str(o.gpus_per_learner)}
            retries, shm = o.learner_retries, o.learner_pod_shm
        else:
            img, limits, retries, shm = image(SYNCER, o.registry), {}, o.syncer_retries, ""
            requests = {"cpu": o.syncer_cpu, "memory": o.syncer_memory}
        out: dict[str, Any] = {
            "image": img,
            "requests": requests,
            "limits": limits,
            "secret_env": dict(SECRET_KEYS),
            "infra_restarts": retries,
            "backoff_s": duration_s(o.backoff),
            "poll_s": o.keeper_poll_s,
        }
        if shm:
            out["shm"] = shm
        if role == "learner" and o.learner_ranks > 1 and o.learner_nodes == 1:
            out["ranks"] = o.learner_ranks  # one rank per GPU of the pod (`ddiloco learner --local-ranks`)
        if o.run_key_secret:
            name, entries = self._run_key(role)
            out["run_key"] = {"secret": name, "entries": entries}
        if role == "learner" and o.learner_nodes > 1:  # a TrainJob (keeper_loop.keep_role)
            out.update(nodes=o.learner_nodes, procs_per_node=o.gpus_per_learner)
        return out

    def chaos(self, task: Any) -> Any:
        self.cpu_step(task, "chaos")
        kubernetes.use_field_path_as_env(task, "DDILOCO_K8S_WORKFLOW", WORKFLOW_LABEL_PATH)
        kubernetes.set_timeout(task, self.opts.run_timeout_s)
        return task
