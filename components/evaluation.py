"""The evaluate step: the built-in evaluator, then lm-evaluation-harness on this package's tasks and on a
team's own task YAMLs from the store, offline.

`lm_eval_tasks` is a store prefix of lm-eval task folders (YAMLs, data files, `!function` modules), copied
locally and handed to `ddiloco evaluate --harness lm-eval --tasks DIR`. `lm_eval_datasets` is a store prefix
holding a Hugging Face datasets cache, copied locally and read offline: nothing is downloaded from the Hub.
The user's tasks are written as `eval/lm-{checkpoint}-tasks.json` and join the step's KFP metrics as
`lm_eval.TASK.METRIC`. Imports neither kfp nor torch (the Metrics artifact is duck-typed).

Design notes: docs/internals.md, "The evaluate step".
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ddiloco.components.runtime import ddiloco, log_metrics, open_run_store

log = logging.getLogger(__name__)

MAX_OBJECT_BYTES = 16 << 30
"""Largest single object copied from a task or datasets-cache prefix (an Arrow shard of a cached dataset)."""


def evaluate(
    metrics: Any,
    root: str,
    model: str,
    *,
    lm_eval: bool = False,
    lm_eval_tasks: str = "",
    lm_eval_datasets: str = "",
    extra_args: Sequence[str] = (),
    s3_endpoint: str = "",
) -> dict[str, Any]:
    """Evaluate checkpoint `model` of the run at `root`, log the numbers to the Metrics artifact, return
    them: the built-in evaluator; with `lm_eval` lm-eval on the package's tasks; with `lm_eval_tasks` lm-eval
    on the YAMLs under that prefix (datasets from the `lm_eval_datasets` cache prefix)."""
    common = {"store": root, "model": model, "s3_endpoint": s3_endpoint}
    result = ddiloco("evaluate", *extra_args, **common) or {}
    if lm_eval_datasets.strip() and not (lm_eval or lm_eval_tasks.strip()):
        log.warning("lm_eval_datasets=%s is unused: set lm_eval or lm_eval_tasks", lm_eval_datasets)
    scores: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="ddiloco-lm-eval-inputs-") as tmp:
        env = {}
        if lm_eval_datasets.strip() and (lm_eval or lm_eval_tasks.strip()):
            cache = copy_prefix(lm_eval_datasets, Path(tmp) / "datasets", s3_endpoint)
            env = {"HF_DATASETS_CACHE": str(cache), "HF_DATASETS_OFFLINE": "1"}
        if lm_eval:
            ours = ddiloco("evaluate", *extra_args, harness="lm-eval", env=env, **common) or {}
            scores |= ours.get("lm_eval") or {}
        if lm_eval_tasks.strip():
            tasks = copy_prefix(lm_eval_tasks, Path(tmp) / "tasks", s3_endpoint)
            name = model.replace(":", "-").replace("/", "_") + "-tasks"
            theirs = ddiloco(
                "evaluate", *extra_args, harness="lm-eval", tasks=tasks, name=name, env=env, **common
            )
            scores |= (theirs or {}).get("lm_eval") or {}
    if scores:
        result["lm_eval"] = scores
    log_metrics(metrics, result)
    return result


def copy_prefix(url: str, dest: Path, s3_endpoint: str = "") -> Path:
    """Every object under the store prefix `url` as a file under `dest` (same relative paths); `dest`."""
    store = open_run_store(url.strip(), s3_endpoint)
    sizes = store.sizes("")
    if not sizes:
        raise ValueError(
            f"{url} holds no objects: give the store prefix you copied the files to (s3://bucket/prefix or "
            "file:///dir)"
        )
    for key, size in sorted(sizes.items()):
        target = dest / key
        if dest.resolve() not in target.resolve().parents:
            raise ValueError(f"{url}: object {key!r} would land outside {dest}; rename it")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(store.get(key, max_bytes=min(size, MAX_OBJECT_BYTES)))
    log.info("copied %s (%d files, %d bytes) to %s", url, len(sizes), sum(sizes.values()), dest)
    return dest
