"""The run-time parameters of the pipelines, each defined once: name, type, default, meaning, the steps that
receive it (as which input) and the run-config key the prepare step sets from it.

Read from here: the pipeline functions' signatures and KFP descriptions (`pipeline_func`), each step's
arguments (`arguments`), the prepare step's `--set` list (`ddiloco.components.runtime.prepare_settings`,
standard library only) and the tables of docs/cluster.md (`ddiloco.pipelines.params_doc`). A receiver is a
component input: KFP runs a lightweight component's own source, so the input is in its function's signature
(components/roles.py, keepers.py), and a table naming an input a step lacks fails the build
(`ddiloco.pipelines.pretrain.task`). What is not one input of one step (the store's bucket and prefix, the
Secret, selectors, tolerations) stays in the pipeline body. A config key is set only from a value that is
not empty (0, blank); empty keeps the recipe's.
"""

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

EVERY_STEP = "*"
"""A receiver: every step of the pipeline, by the parameter's name."""
CHECKED = ("tokenize_plan",)
"""The run's first step: it checks the run parameters as prepare, the drivers and the keepers use them."""
KEEPERS = ("learner_keeper", "syncer_keeper")
S3_ENDPOINT = "seaweedfs.kubeflow:9000"
"""KFP >= 2.16 ships SeaweedFS here; older releases MinIO at minio-service.kubeflow:9000."""
KFP_SECRET = "mlpipeline-minio-artifact"
"""KFP's artifact-store Secret (keys accesskey / secretkey), in every profile namespace."""
GPU_TOLERATIONS = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]


@dataclass(frozen=True)
class Param:
    """One run-time parameter, e.g. `Param("quorum", int, 0, "K, ...", to=("tokenize_plan", "prepare"),
    config="diloco.quorum")`."""

    name: str
    type: type
    default: Any
    description: str
    to: Sequence[str] = ()
    """Receivers: a step (`Components` field name) taking it as its input of the same name, `step.input`
    for another name, or `EVERY_STEP`."""
    config: str = ""
    """The run-config key the prepare step sets from its input of this name (`diloco.quorum`)."""


RUN = (*CHECKED, "prepare")
"""The steps that make the run config from the parameter: checked first, set by prepare."""
PRETRAIN: tuple[Param, ...] = (
    Param(
        "recipe",
        str,
        "small-gpu",
        "The recipe the run starts from: tiny-cpu, small-gpu, paper-like or sync-diloco.",
        to=RUN,
    ),
    Param(
        "overrides",
        list,
        [],
        "JSON list of config overrides key=value applied to the recipe, e.g. "
        '["diloco.codec=int4", "model.preset=350m"]; unknown keys are refused with a did-you-mean when the '
        "pipeline is compiled or submitted.",
        to=RUN,
    ),
    Param(
        "learners",
        int,
        4,
        "M, the learners of this run (at most the compiled --max-learners).",
        to=RUN,
        config="diloco.learners",
    ),
    Param(
        "quorum",
        int,
        0,
        "K, the minimum learner answers per merge; 0 keeps the recipe's.",
        to=RUN,
        config="diloco.quorum",
    ),
    Param(
        "token_budget",
        int,
        0,
        "Tokens to merge before the run ends; 0 keeps the recipe's.",
        to=RUN,
        config="diloco.token_budget",
    ),
    Param(
        "chaos",
        str,
        "",
        'The chaos section as JSON/YAML, e.g. {"events": [{"kind": "kill_learner", '
        '"learner": 1, "at_s": 600}], "poisson": {"mean_interval_s": 900}}; empty: no chaos.',
        to=RUN,
        config="chaos",
    ),
    Param(
        "model_hf",
        str,
        "",
        "A Hugging Face model directory or store prefix to train (model.hf); empty: the built-in GPT.",
        to=RUN,
        config="model.hf",
    ),
    # prepare's own `corpus` input is the tokenize steps' output, which passes this one on
    Param(
        "corpus",
        str,
        "",
        "A pre-tokenized corpus read in place: a store prefix of .npy token files "
        "(data.source); empty: the recipe's data.",
        to=CHECKED,
        config="data.source",
    ),
    Param(
        "text_corpus",
        str,
        "",
        "A store prefix of .txt/.jsonl/.parquet/datasets files, tokenized (one pod "
        "per file, --tokenize-parallelism at once) under s3://bucket/prefix/corpora/corpus-KEY "
        "(content-addressed: a rerun on the same text reuses it) and read in place; empty: none.",
        to=CHECKED,
    ),
    Param(
        "lm_eval",
        bool,
        False,
        "Also run lm-evaluation-harness on the package's tasks in the evaluate steps.",
        to=("evaluate",),
    ),
    Param(
        "lm_eval_tasks",
        str,
        "",
        "A store prefix (s3://bucket/prefix or file:///dir) of "
        "lm-evaluation-harness task YAMLs with their data files and utils.py, e.g. folders copied from "
        "lm_eval/tasks/; the evaluate steps copy it and run every task it defines (TaskManager "
        "include_path), offline; a relative data_files path in a YAML is a file of the prefix. Results: "
        "eval/lm-final-tasks.json, metrics lm_eval.TASK.METRIC. Empty: none.",
        to=("evaluate",),
    ),
    Param(
        "lm_eval_datasets",
        str,
        "",
        "A store prefix holding a Hugging Face datasets cache (a copy of "
        "~/.cache/huggingface/datasets after loading the benchmarks once), used as HF_DATASETS_CACHE with "
        "HF_DATASETS_OFFLINE=1 so tasks with a Hub dataset_path (hellaswag, arc_easy, ...) load without "
        "internet. Empty: none.",
        to=("evaluate",),
    ),
    Param(
        "store_bucket", str, "mlpipeline", "Bucket of the run data: s3://store_bucket/store_prefix/<run id>."
    ),
    Param(
        "store_prefix",
        str,
        "private/{namespace}/ddiloco",
        "Prefix of the run data in the bucket; {namespace} is the run's namespace.",
    ),
    Param(
        "s3_endpoint",
        str,
        S3_ENDPOINT,
        "The S3 endpoint, host:port or https://host:port "
        "(KFP >= 2.16: seaweedfs.kubeflow:9000, older: minio-service.kubeflow:9000).",
        to=(EVERY_STEP,),
    ),
    Param(
        "store_secret",
        str,
        KFP_SECRET,
        "Kubernetes Secret with the store credentials (keys accesskey / secretkey).",
        to=KEEPERS,
    ),
    Param(
        "gpu_node_selector",
        dict,
        {},
        "Node selector of learners, evaluation and SFT (JSON object; the GPU "
        'request already needs a GPU node), e.g. {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}.',
        to=CHECKED,
    ),
    Param(
        "gpu_tolerations",
        list,
        GPU_TOLERATIONS,
        "Tolerations of learners, evaluation and SFT (JSON list of v1 Tolerations).",
        to=CHECKED,
    ),
    Param(
        "cpu_node_selector",
        dict,
        {},
        "Node selector of the CPU steps: tokenize, prepare, syncer, chaos, export, report.",
        to=CHECKED,
    ),
    Param(
        "kueue_queue",
        str,
        "",
        "Kueue LocalQueue of the worker pods and TrainJobs the keepers create; empty: no Kueue.",
        to=(*CHECKED, *KEEPERS),
    ),
    Param(
        "pod_settings",
        dict,
        {},
        "Settings of the worker pods the keepers create (JSON object): "
        "priority_class, affinity, image_pull_secrets, labels, annotations.",
        to=(*CHECKED, *KEEPERS),
    ),
)
"""The `pretrain` and `smoke` pipelines' parameters, in the order the docs list them."""
JOIN: tuple[Param, ...] = (
    Param(
        "run_root",
        str,
        "s3://mlpipeline/ddiloco/RUN_ID",
        "The owner's run root, s3://BUCKET/PREFIX/KFP_RUN_ID of its pretrain run.",
        to=("join_check.store", "joiner.store"),
    ),
    Param(
        "site",
        str,
        "remote",
        "Label of this cluster's learners in the owner's reports and metrics, e.g. eu-west.",
        to=("joiner",),
    ),
    Param("learners", int, 2, "Learners this cluster adds to the owner's run.", to=("join_check",)),
    Param(
        "s3_endpoint",
        str,
        S3_ENDPOINT,
        "How this cluster reaches the owner's store (host:port or https://host:port).",
        to=(EVERY_STEP,),
    ),
    Param(
        "store_secret",
        str,
        KFP_SECRET,
        "This cluster's Secret for the owner's store (keys accesskey / secretkey).",
    ),
    Param(
        "link_bandwidth",
        str,
        "",
        "Emulated bandwidth of this site's link, e.g. 100Mbit; empty: none.",
        to=("joiner",),
    ),
    Param(
        "link_latency",
        str,
        "",
        "Emulated one-way latency of this site's link, e.g. 50ms; empty: none.",
        to=("joiner",),
    ),
    Param("gpu_node_selector", dict, {}, "Node selector of this cluster's learners (JSON object)."),
    Param(
        "gpu_tolerations",
        list,
        GPU_TOLERATIONS,
        "Tolerations of this cluster's learners (JSON list of v1 Tolerations).",
    ),
    Param("cpu_node_selector", dict, {}, "Node selector of the check step (JSON object)."),
)
"""The `join` pipeline's parameters."""


def defaults(table: Sequence[Param]) -> dict[str, Any]:
    return {p.name: p.default for p in table}


def description(table: Sequence[Param], name: str) -> str:
    """The description of parameter `name` of `table` ("" when it has none)."""
    return next((p.description for p in table if p.name == name), "")


def arguments(table: Sequence[Param], values: Mapping[str, Any], step: str) -> dict[str, Any]:
    """The inputs of `step` that the parameters of `table` feed: input name -> the parameter's `values`."""
    out = {}
    for p in table:
        for receiver in p.to:
            target, _, name = receiver.partition(".")
            if target in (step, EVERY_STEP):
                out[name or p.name] = values[p.name]
    return out


def configured() -> list[Param]:
    """The parameters the prepare step turns into run-config keys, in the order it sets them (`join` has none)."""
    return [p for p in PRETRAIN if p.config]


def pipeline_func(
    name: str, table: Sequence[Param], values: Mapping[str, Any], body: Callable[[dict[str, Any]], None]
) -> Callable[..., None]:
    """A function KFP reads as a pipeline: one parameter per row of `table` (its type, its default from
    `values`), the rows' descriptions as the docstring's `Args:`; KFP calls it with the parameters' channels,
    and it calls `body` with them by name."""
    sig = inspect.Signature(
        [
            inspect.Parameter(
                p.name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=values[p.name], annotation=p.type
            )
            for p in table
        ]
    )

    def pipeline(*args: Any, **kwargs: Any) -> None:
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        body(dict(bound.arguments))

    pipeline.__signature__ = sig  # type: ignore[attr-defined]
    pipeline.__name__ = pipeline.__qualname__ = name
    pipeline.__doc__ = f"{name}.\n\nArgs:\n" + "\n".join(f"    {p.name}: {p.description}" for p in table)
    return pipeline
