"""The KFP components: one `ddiloco` role each, as lightweight Python components on our own images.

Each body is one call into `ddiloco.components.runtime` (run the role, log what it returned); everything a person
turns in the UI is an input. The images already hold ddiloco and kfp (`install_kfp_package=False`), and
their tag is the package version (`ddiloco.components.images`). Lightweight Python components, not container
components, so that the same components also run under `kfp.local.SubprocessRunner` in the tests.

Store access: `store` is the store base (`s3://bucket/prefix`, `{namespace}` = the pod's namespace) and
`run_id` the run; the run root is `{store}/{run_id}` (`ddiloco.components.runtime.run_root`; an empty run_id takes
`store` as the run root, for use by hand). The pipelines pass `run_id` as the whole value
`{{$.pipeline_job_uuid}}`, the only form KFP's driver resolves. `s3_endpoint` becomes
DDILOCO_S3_ENDPOINT for the role, and the credentials come from a Secret as environment variables (the
pipeline maps them). An empty `s3_endpoint` keeps the environment's (local runs, `file://` stores).
"""

from dataclasses import dataclass
from typing import Any, NamedTuple

from ddiloco.components import keepers
from ddiloco.components.descriptions import described
from ddiloco.components.images import DEFAULT_REGISTRY, LEARNER, SYNCER, image
from kfp import dsl
from kfp.dsl import HTML, Markdown, Metrics, Model, Output


def prepare(
    store: str,
    run_id: str,
    s3_endpoint: str = "",
    recipe: str = "tiny-cpu",
    overrides: list = [],  # noqa: B006 (a KFP default, never mutated)
    learners: int = 4,
    quorum: int = 0,
    token_budget: int = 0,
    chaos: str = "",
    max_learners: int = 64,
    model_hf: str = "",
    corpus: str = "",
    learner_ranks: int = 1,
) -> list[int]:
    """Write the run config, tokenizer, data shards, validation split and global version 0 to the run root;
    return the learner ids. quorum / token_budget 0 keep the recipe's; chaos is a YAML/JSON chaos section;
    model_hf names a Hugging Face model directory or store prefix to train (`model.hf`), empty: the recipe's;
    corpus: a pre-tokenized corpus read in place (`data.source`; the `tokenize` step's output);
    learner_ranks: the ranks each learner pod starts (`train.ranks`, unless an override raises it)."""
    inputs = dict(locals())  # by name: the run-config keys come from ddiloco.components.params
    from ddiloco.components.runtime import ddiloco, prepare_settings, run_root

    settings = prepare_settings(inputs)
    root = run_root(store, run_id)
    ddiloco("prepare", store=root, recipe=recipe, run_id=run_id, set=settings, s3_endpoint=s3_endpoint)
    return list(range(learners))


def tokenize_plan(
    store: str,
    s3_endpoint: str = "",
    text_corpus: str = "",
    corpus: str = "",
    model_hf: str = "",
    recipe: str = "",
    overrides: list = [],  # noqa: B006 (a KFP default, never mutated)
    learners: int = 1,
    quorum: int = 0,
    token_budget: int = 0,
    chaos: str = "",
    max_learners: int = 64,
    learner_ranks: int = 1,
    gpu_node_selector: dict = {},  # noqa: B006 (a KFP default, never mutated)
    gpu_tolerations: list = [],  # noqa: B006 (a KFP default, never mutated)
    cpu_node_selector: dict = {},  # noqa: B006 (a KFP default, never mutated)
    kueue_queue: str = "",
    pod_settings: dict = {},  # noqa: B006 (a KFP default, never mutated)
) -> NamedTuple("Plan", [("units", list[int]), ("corpus", str), ("tokenized", bool)]):  # noqa: F821
    """The run's first step. It checks the run parameters as prepare, the drivers and the keepers will use
    them (a misspelt override fails the run here with a did-you-mean, in seconds; empty recipe: no check);
    then the data of the run,
    step 1: `text_corpus` (a store prefix of .txt/.jsonl/.parquet/datasets files) planned for tokenizing under
    `{store}/corpora/corpus-KEY` (content-addressed: a rerun or a schedule on the same text reuses it, and
    has no units), with the tokenizer of `model_hf` if it has one, else bytes; or `corpus` (a pre-tokenized
    prefix) passed on; or neither (the recipe's data). Units: one per input file."""
    inputs = dict(locals())  # by name: every run parameter this step checks
    from collections import namedtuple

    from ddiloco.components.runtime import tokenize_plan as plan

    return namedtuple("Plan", ["units", "corpus", "tokenized"])(*plan(inputs))


def tokenize_unit(corpus: str, unit: int, s3_endpoint: str = ""):
    """Step 2, a ParallelFor over the plan's units: one input file into .npy parts (`ddiloco tokenize
    --stage unit`); a unit already done is skipped."""
    from ddiloco.components.runtime import ddiloco

    ddiloco("tokenize", stage="unit", corpus=corpus, unit=unit, s3_endpoint=s3_endpoint)


def tokenize_finish(corpus: str, tokenized: bool, s3_endpoint: str = "") -> str:
    """Step 3: the manifest of a corpus tokenized here (written once every unit is done); its URL, which
    prepare reads as `data.source` (empty: the recipe's data)."""
    from ddiloco.components.runtime import tokenize_finish as finish

    return finish(corpus, tokenized, s3_endpoint)


def learner(
    store: str,
    learner_id: int,
    run_id: str = "",
    s3_endpoint: str = "",
    device: str = "",
    max_steps: int = 0,
    metrics_port: int = -1,
    restarts: int = 0,
    local_ranks: int = 1,
):
    """One learner until the run is done (max_steps > 0: stop after that many inner steps); Prometheus
    /metrics on metrics_port (-1: off); a crash is restarted in the pod up to `restarts` times;
    `local_ranks` > 1: that many ranks in the pod (one per GPU, `ddiloco learner --local-ranks`)."""
    from ddiloco.components.runtime import ddiloco, run_root

    ddiloco(
        "learner",
        store=run_root(store, run_id),
        restarts=restarts,
        learner_id=learner_id,
        local_ranks=local_ranks if local_ranks > 1 else None,
        device=device or None,
        max_steps=max_steps or None,
        metrics_port=None if metrics_port < 0 else metrics_port,
        s3_endpoint=s3_endpoint,
    )


def syncer(
    store: str,
    run_id: str = "",
    s3_endpoint: str = "",
    max_seconds: float = 0.0,
    metrics_port: int = -1,
    restarts: int = 0,
):
    """The syncer until the token budget is merged (Prometheus /metrics on metrics_port, -1: off); it writes
    the final model to the run root (`export_final` makes the Model artifact of it); a crash is restarted
    in the pod up to `restarts` times (it resumes from its state in the store)."""
    from ddiloco.components.runtime import ddiloco, run_root

    ddiloco(
        "syncer",
        store=run_root(store, run_id),
        max_seconds=max_seconds or None,
        metrics_port=None if metrics_port < 0 else metrics_port,
        s3_endpoint=s3_endpoint,
        restarts=restarts,
    )


def chaos(
    store: str,
    events: Output[Markdown],
    run_id: str = "",
    s3_endpoint: str = "",
    backend: str = "kubernetes",
    selector: str = "ddiloco.io/role in (learner,syncer)",
):
    """Fire the run's timed chaos schedule at this run's learner / syncer pods; Markdown = what it did."""
    from ddiloco.components.runtime import ddiloco, run_root

    ddiloco(
        "chaos",
        store=run_root(store, run_id),
        backend=backend,
        selector=selector,
        markdown_out=events.path,
        s3_endpoint=s3_endpoint,
    )


def evaluate(
    store: str,
    metrics: Output[Metrics],
    run_id: str = "",
    s3_endpoint: str = "",
    model: str = "final",
    lm_eval: bool = False,
    lm_eval_tasks: str = "",
    lm_eval_datasets: str = "",
    extra_args: list = [],  # noqa: B006 (a KFP default, never mutated)
):
    """Validation loss, perplexity and task accuracy of a checkpoint (final, sft, latest, round:N); with
    lm_eval also lm-evaluation-harness on the same tasks, with lm_eval_tasks on the task YAMLs of that store
    prefix (datasets from the lm_eval_datasets cache, offline): metrics lm_eval.TASK.METRIC; extra_args go
    to `ddiloco evaluate` as they are."""
    from ddiloco.components.evaluation import evaluate as run_evaluation
    from ddiloco.components.runtime import run_root

    run_evaluation(
        metrics,
        run_root(store, run_id),
        model,
        lm_eval=lm_eval,
        lm_eval_tasks=lm_eval_tasks,
        lm_eval_datasets=lm_eval_datasets,
        extra_args=extra_args,
        s3_endpoint=s3_endpoint,
    )


def sft(
    store: str,
    metrics: Output[Metrics],
    run_id: str = "",
    s3_endpoint: str = "",
    extra_args: list = [],  # noqa: B006 (a KFP default, never mutated)
):
    """Supervised fine-tuning of the final model, written to the run root (`export_sft` makes the Model
    artifact of it); extra_args go to `ddiloco sft` as they are. A user corpus without sft.data skips it (and
    the evaluation of `sft` after it) with a warning."""
    from ddiloco.components.runtime import ddiloco, log_metrics, run_root

    done = ddiloco(
        "sft", *extra_args, store=run_root(store, run_id), skip_without_data=True, s3_endpoint=s3_endpoint
    )
    log_metrics(metrics, done)


def export_final(store: str, final_model: Output[Model], run_id: str = "", s3_endpoint: str = ""):
    """The final model as a Hugging Face directory in the Model artifact (config.json, model.safetensors,
    generation_config.json, the run's tokenizer: `ddiloco export`), which transformers' from_pretrained loads
    alone; metadata: architecture, parameters, tokens trained, validation loss."""
    from ddiloco.components.models import export_model
    from ddiloco.components.runtime import run_root

    export_model(final_model, run_root(store, run_id), "final", s3_endpoint)


def export_sft(store: str, sft_model: Output[Model], run_id: str = "", s3_endpoint: str = ""):
    """The fine-tuned model as a Hugging Face directory in the Model artifact (as `export_final`); empty with
    metadata present false when SFT was skipped."""
    from ddiloco.components.models import export_model
    from ddiloco.components.runtime import run_root

    export_model(sft_model, run_root(store, run_id), "sft", s3_endpoint)


def report(
    store: str,
    html: Output[HTML],
    markdown: Output[Markdown],
    summary: Output[Metrics],
    run_id: str = "",
    s3_endpoint: str = "",
):
    """The run report (HTML and Markdown, rendered by the KFP UI) and the summary's headline numbers; the
    pipeline's exit handler, so a failed run gets one too (saying how far it got)."""
    from ddiloco.components.runtime import run_report, run_root

    run_report(run_root(store, run_id), html, markdown, summary, s3_endpoint)


def join_check(store: str, s3_endpoint: str = "", learners: int = 2, max_learners: int = 8) -> list[int]:
    """Check that this cluster reads a prepared run at `store` with its own credentials; return the slots of
    the learners to start."""
    from ddiloco.components.runtime import join_slots

    return join_slots(store, learners, max_learners, s3_endpoint)


def joiner(
    store: str,
    site: str,
    run_tag: str,
    slot: int,
    s3_endpoint: str = "",
    device: str = "",
    link_bandwidth: str = "",
    link_latency: str = "",
    metrics_port: int = -1,
    restarts: int = 0,
):
    """One learner of this cluster joined to the run at `store` (`ddiloco learner --join`): it claims a free
    learner id, and a retry of the same slot takes that id back; reports and metrics carry `site`; a crash
    is restarted in the pod up to `restarts` times."""
    from ddiloco.components.runtime import ddiloco, join_name

    ddiloco(
        "learner",
        join=store,
        site=site,
        join_name=join_name(run_tag, slot),
        device=device or None,
        link_bandwidth=link_bandwidth or None,
        link_latency=link_latency or None,
        metrics_port=None if metrics_port < 0 else metrics_port,
        s3_endpoint=s3_endpoint,
        restarts=restarts,
    )


@dataclass(frozen=True)
class Components:
    tokenize_plan: Any
    tokenize_unit: Any
    tokenize_finish: Any
    prepare: Any
    learner: Any
    syncer: Any
    chaos: Any
    evaluate: Any
    sft: Any
    export_final: Any
    export_sft: Any
    report: Any
    join_check: Any
    joiner: Any
    learner_keeper: Any
    syncer_keeper: Any


def build(registry: str = DEFAULT_REGISTRY, *, gpu: bool = True) -> Components:
    """The components on `{registry}/ddiloco-{learner,syncer}:{version}`. gpu=True runs learners, evaluation
    and SFT on the CUDA image; gpu=False (CPU-only clusters) runs everything on the slim CPU image."""
    cpu_image, gpu_image = image(SYNCER, registry), image(LEARNER if gpu else SYNCER, registry)

    def on(img: str, func: Any) -> Any:
        return dsl.component(described(func), base_image=img, install_kfp_package=False)

    return Components(
        tokenize_plan=on(cpu_image, tokenize_plan),
        tokenize_unit=on(cpu_image, tokenize_unit),
        tokenize_finish=on(cpu_image, tokenize_finish),
        prepare=on(cpu_image, prepare),
        learner=on(gpu_image, learner),
        syncer=on(cpu_image, syncer),
        chaos=on(cpu_image, chaos),
        evaluate=on(gpu_image, evaluate),
        sft=on(gpu_image, sft),
        export_final=on(cpu_image, export_final),
        export_sft=on(cpu_image, export_sft),
        report=on(cpu_image, report),
        join_check=on(cpu_image, join_check),
        joiner=on(gpu_image, joiner),
        learner_keeper=on(cpu_image, keepers.learner),
        syncer_keeper=on(cpu_image, keepers.syncer),
    )
