"""What every component input and output means, for the KFP UI.

KFP 2.17 takes the descriptions of a component's inputs and outputs from its function's Google-style
docstring (`Args:` for inputs, `Returns:` for outputs: kfp/dsl/component_factory.py
`extract_component_interface`, parsed with `docstring_parser`); `described` writes that docstring from
`DESCRIPTIONS`, and an input a run-time parameter feeds under its own name from that parameter's row
(`ddiloco.components.params`, which describes the pipelines' own parameters). A name missing in both fails
the compile, so no input goes undescribed.

Keys: a plain name (`store`), or `function.name` where one function means something else by it
(`join_check.learners`, `prepare.Output`); the qualified key wins. Outputs of one value are named `Output`.
"""

import functools
import inspect
from collections.abc import Callable
from typing import Any

from ddiloco.components import params
from kfp.dsl.types import type_annotations

DESCRIPTIONS: dict[str, str] = {
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
    for table in (params.PRETRAIN, params.JOIN):
        if text := params.description(table, name):
            return text
    raise ValueError(
        f"no description of {owner}'s {name!r}: add it to ddiloco.components.descriptions (a run parameter's "
        "row in ddiloco.components.params describes an input of its name)"
    )


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
    """A copy of `func` whose docstring describes every input and output (for `dsl.component`; the original
    function is left as it is). inspect follows `__wrapped__` to `func` for the signature and the source a
    lightweight component embeds."""

    @functools.wraps(func)
    def copy(*args: Any, **kwargs: Any) -> Any:
        return func(*args, **kwargs)

    copy.__doc__ = docstring(func)
    return copy
