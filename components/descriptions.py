"""What every pipeline parameter and component input/output means: the one table the KFP UI and the docs read.

KFP 2.17 takes the descriptions of a pipeline's or component's inputs and outputs from its function's
Google-style docstring (`Args:` for inputs, `Returns:` for outputs: kfp/dsl/component_factory.py
`extract_component_interface`, parsed with `docstring_parser`); `described` writes that docstring from
`DESCRIPTIONS`, and the parameter tables of docs/cluster.md are rendered from it too
(`ddiloco.pipelines.params_doc`). A name missing here fails the compile, so no input goes undescribed.

Keys: a plain name (`store`), or `function.name` where one function means something else by it (the join
pipeline's `learners`, `prepare.Output`); the qualified key wins. Outputs of one value are named `Output`.
"""

import functools
import inspect
from collections.abc import Callable
from typing import Any

from kfp.dsl.types import type_annotations

DESCRIPTIONS: dict[str, str] = {
    # --- run-time parameters of pretrain and smoke (the KFP UI's "Run parameters") ---
    "recipe": "The recipe the run starts from: tiny-cpu, small-gpu, paper-like or sync-diloco.",
    "overrides": 'JSON list of config overrides key=value applied to the recipe, e.g. ["diloco.codec=int4", '
    '"model.preset=350m"]; unknown keys are refused with a did-you-mean when the pipeline is compiled or '
    "submitted.",
    "learners": "M, the learners of this run (at most the compiled --max-learners).",
    "quorum": "K, the minimum learner answers per merge; 0 keeps the recipe's.",
    "token_budget": "Tokens to merge before the run ends; 0 keeps the recipe's.",
    "chaos": 'The chaos section as JSON/YAML, e.g. {"events": [{"kind": "kill_learner", "learner": 1, '
    '"at_s": 600}], "poisson": {"mean_interval_s": 900}}; empty: no chaos.',
    "model_hf": "A Hugging Face model directory or store prefix to train (model.hf); empty: the built-in GPT.",
    "corpus": "A pre-tokenized corpus read in place: a store prefix of .npy token files (data.source); "
    "empty: the recipe's data.",
    "text_corpus": "A store prefix of .txt/.jsonl/.parquet/datasets files, tokenized (one pod per file, "
    "--tokenize-parallelism at once) under "
    "s3://bucket/prefix/corpora/corpus-KEY (content-addressed: a rerun on the same text reuses it) and read "
    "in place; empty: none.",
    "lm_eval": "Also run lm-evaluation-harness on the package's tasks in the evaluate steps.",
    "lm_eval_tasks": "A store prefix (s3://bucket/prefix or file:///dir) of lm-evaluation-harness task YAMLs with "
    "their data files and utils.py, e.g. folders copied from lm_eval/tasks/; the evaluate steps copy it and "
    "run every task it defines (TaskManager include_path), offline; a relative data_files path in a YAML is a "
    "file of the prefix. Results: eval/lm-final-tasks.json, metrics lm_eval.TASK.METRIC. Empty: none.",
    "lm_eval_datasets": "A store prefix holding a Hugging Face datasets cache (a copy of "
    "~/.cache/huggingface/datasets after loading the benchmarks once), used as HF_DATASETS_CACHE with "
    "HF_DATASETS_OFFLINE=1 so tasks with a Hub dataset_path (hellaswag, arc_easy, ...) load without internet. "
    "Empty: none.",
    "store_bucket": "Bucket of the run data: s3://store_bucket/store_prefix/<run id>.",
    "store_prefix": "Prefix of the run data in the bucket; {namespace} is the run's namespace.",
    "s3_endpoint": "The S3 endpoint, host:port or https://host:port (KFP >= 2.16: seaweedfs.kubeflow:9000, "
    "older: minio-service.kubeflow:9000).",
    "store_secret": "Kubernetes Secret with the store credentials (keys accesskey / secretkey).",
    "gpu_node_selector": "Node selector of learners, evaluation and SFT (JSON object; the GPU request already "
    'needs a GPU node), e.g. {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}.',
    "gpu_tolerations": "Tolerations of learners, evaluation and SFT (JSON list of v1 Tolerations).",
    "cpu_node_selector": "Node selector of the CPU steps: tokenize, prepare, syncer, chaos, export, report.",
    "kueue_queue": "Kueue LocalQueue of the worker pods and TrainJobs the keepers create; empty: no Kueue.",
    "pod_settings": "Settings of the worker pods the keepers create (JSON object): priority_class, affinity, "
    "image_pull_secrets, labels, annotations.",
    # --- run-time parameters of join ---
    "run_root": "The owner's run root, s3://BUCKET/PREFIX/KFP_RUN_ID of its pretrain run.",
    "site": "Label of this cluster's learners in the owner's reports and metrics, e.g. eu-west.",
    "join.learners": "Learners this cluster adds to the owner's run.",
    "join.s3_endpoint": "How this cluster reaches the owner's store (host:port or https://host:port).",
    "join.store_secret": "This cluster's Secret for the owner's store (keys accesskey / secretkey).",
    "join.gpu_node_selector": "Node selector of this cluster's learners (JSON object).",
    "join.gpu_tolerations": "Tolerations of this cluster's learners (JSON list of v1 Tolerations).",
    "join.cpu_node_selector": "Node selector of the check step (JSON object).",
    "link_bandwidth": "Emulated bandwidth of this site's link, e.g. 100Mbit; empty: none.",
    "link_latency": "Emulated one-way latency of this site's link, e.g. 50ms; empty: none.",
    # --- component inputs ---
    "store": "The store base s3://bucket/prefix ({namespace}: the pod's namespace); the run root is "
    "{store}/{run_id}.",
    "run_id": "The run id (the KFP run id); the run root is {store}/{run_id}; empty: store is the run root.",
    "join_check.store": "The owner's run root.",
    "joiner.store": "The owner's run root.",
    "max_learners": "The pipeline's ParallelFor cap: one data shard is cut per learner id below it.",
    "learner_ranks": "Ranks each learner starts (train.ranks, unless an override raises it).",
    "join_check.learners": "Learners this cluster adds to the owner's run.",
    "unit": "The input file (unit of the plan) this step tokenizes.",
    "tokenized": "Whether the corpus is tokenized by this run's tokenize steps (else passed on as it is).",
    "tokenize_unit.corpus": "The corpus URL the plan chose, where the unit's .npy parts go.",
    "tokenize_finish.corpus": "The corpus URL the plan chose.",
    "learner_id": "This learner's id (an item of prepare's output).",
    "device": "Torch device of the role; empty: automatic.",
    "max_steps": "Stop after this many inner steps; 0: until the run is done.",
    "max_seconds": "Stop after this many seconds; 0: until the token budget is merged.",
    "metrics_port": "Port of the role's Prometheus /metrics; -1: off.",
    "restarts": "Restarts of the role after a crash (it resumes from its state in the store).",
    "local_ranks": "Ranks in the pod, one per GPU (ddiloco learner --local-ranks); 1: one process.",
    "worker": "The worker pod the keeper creates: image, resources, ranks, shm, env, labels (compile-time).",
    "node_selector": "Node selector of the worker pod.",
    "tolerations": "Tolerations of the worker pod.",
    "backend": "Where chaos fires: kubernetes (delete this run's pods).",
    "selector": "Label selector of the pods chaos may delete (with this run's workflow label).",
    "model": "The checkpoint: final, sft, latest or round:N.",
    "extra_args": "More command-line arguments for the ddiloco command of this step, as they are.",
    "run_tag": "This KFP run's id: with the slot, the join name that lets a retry take its learner id back.",
    "slot": "This learner's slot (an item of the check step's output).",
    # --- component outputs ---
    "final_model": "The final global model as a Hugging Face directory that transformers' from_pretrained "
    "loads; metadata: architecture, parameters, tokens_trained, val_loss, perplexity.",
    "sft_model": "The fine-tuned model as a Hugging Face directory (as final_model); empty with metadata "
    "present false when SFT was skipped.",
    "metrics": "Headline metrics of the step (validation loss, perplexity, accuracy, ...).",
    "events": "Markdown: the chaos events this step fired or skipped.",
    "html": "The run report, HTML.",
    "markdown": "The run report, Markdown.",
    "summary": "Headline numbers of the run's summary.json.",
    "units": "The units (input files) left to tokenize.",
    "tokenize_plan.corpus": "The corpus URL prepare reads (empty: the recipe's data).",
    "tokenize_plan.tokenized": "Whether the corpus is tokenized by this run's tokenize steps.",
    "prepare.Output": "The learner ids to start.",
    "join_check.Output": "The slots of the learners to start.",
    "tokenize_finish.Output": "The corpus URL prepare reads as data.source (empty: the recipe's data).",
}


def describe(owner: str, name: str) -> str:
    """The description of input/output `name` of function `owner`; a missing one is a ValueError."""
    for key in (f"{owner}.{name}", name):
        if DESCRIPTIONS.get(key, "").strip():
            return DESCRIPTIONS[key]
    raise ValueError(f"no description of {owner}'s {name!r}: add it to ddiloco.components.descriptions")


def _outputs(func: Callable[..., Any]) -> tuple[list[str], list[str]]:
    """(input names, output names) of a KFP component or pipeline function."""
    sig = inspect.signature(func)
    params = sig.parameters.items()
    outs = [n for n, p in params if type_annotations.is_artifact_wrapped_in_Output(p.annotation)]
    ins = [n for n in sig.parameters if n not in outs]
    ret = sig.return_annotation
    if ret not in (inspect.Signature.empty, None):
        outs += list(getattr(ret, "_fields", None) or ["Output"])
    return ins, outs


def docstring(func: Callable[..., Any]) -> str:
    """`func`'s docstring with `Args:` and `Returns:` sections written from `DESCRIPTIONS`."""
    ins, outs = _outputs(func)
    owner = func.__name__
    # a first line without a docstring: docstring_parser would read "Args:" as the summary
    text = (inspect.getdoc(func) or f"{owner}.").rstrip()
    for title, names in (("Args", ins), ("Returns", outs)):
        if names:
            text += f"\n\n{title}:\n" + "\n".join(f"    {n}: {describe(owner, n)}" for n in names)
    return text


def described(func: Callable[..., Any]) -> Callable[..., Any]:
    """A copy of `func` whose docstring describes every input and output (for `dsl.component` and
    `dsl.pipeline`; the original function is left as it is). inspect follows `__wrapped__` to `func` for the
    signature and the source a lightweight component embeds."""

    @functools.wraps(func)
    def copy(*args: Any, **kwargs: Any) -> Any:
        return func(*args, **kwargs)

    copy.__doc__ = docstring(func)
    return copy
