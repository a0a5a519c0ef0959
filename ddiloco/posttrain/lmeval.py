"""`ddiloco evaluate --harness lm-eval`: a checkpoint scored by EleutherAI's lm-evaluation-harness.

lm-eval scores the run's checkpoint exported as a Hugging Face directory (`ddiloco.posttrain.export`), loaded by
its own `hf` model in fp32; nothing is fetched (`HF_HUB_OFFLINE`, `HF_DATASETS_OFFLINE`, local files only).
This package's own tasks (`ddiloco.posttrain.tasks`) go to lm-eval as task YAMLs over local JSONL files,
built so that both evaluators score the same ids (they agree exactly with the byte tokenizer, within
lm-eval's stderr otherwise); exact match is scored by `lmeval_hooks.py` with the built-in rule.
`--tasks DIR` runs the user's task YAMLs instead, with DIR as the working directory. Results are lm-eval's
own JSON, written to `eval/lm-{name}.json` in the run root with the checkpoint's description.

Design notes (how contexts are encoded, where the evaluators can differ): docs/internals.md,
"lm-evaluation-harness".
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from ddiloco.data.tokenizer import EOS, ModelTokenizer, Tokenizer
from ddiloco.posttrain.tasks import TaskItem
from ddiloco.run.root import RunRoot

log = logging.getLogger(__name__)

PREFIX = "ddiloco_"
"""Task names of this package's own tasks in lm-eval (ddiloco_fact_mc, ...)."""
KEPT = ("results", "versions", "n-samples", "configs", "higher_is_better", "n-shot", "group_subtasks")
"""The parts of lm-eval's output written to the run root (the rest describes the process that ran it)."""


def eos_text(tokenizer: Tokenizer) -> str:
    """The text the exported tokenizer encodes to the eos id (`ddiloco.posttrain.export`)."""
    return tokenizer.eos_token if isinstance(tokenizer, ModelTokenizer) and tokenizer.eos_token else EOS


def write_task_dir(tasks: dict[str, list[TaskItem]], tokenizer: Tokenizer, out: Path) -> list[str]:
    """Task YAMLs + JSONL data for `tasks` in `out`; returns the lm-eval task names."""
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(Path(__file__).parent / "lmeval_hooks.py", out / "utils.py")  # `!function utils.…`
    eos, names = eos_text(tokenizer), []
    for name, items in sorted(tasks.items()):
        if not items:
            continue
        if any(it.chat for it in items):
            raise ValueError(f"task {name}: instruction items (chat) are not exported to lm-eval")
        data = out / f"{name}.jsonl"
        rows = [
            {
                "context": eos + it.prompt,
                "answer": it.answer,
                "choices": list(it.choices),
                "gold": it.choices.index(it.answer) if it.choices else -1,
            }
            for it in items
        ]
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        spec: dict[str, Any] = {
            "task": PREFIX + name,
            "dataset_path": "json",
            "dataset_kwargs": {"data_files": {"test": str(data)}},
            "test_split": "test",
            "doc_to_text": "{{context}}",
            "target_delimiter": "",
        }
        if items[0].choices:
            spec |= {
                "output_type": "multiple_choice",
                "doc_to_choice": "{{choices}}",
                "doc_to_target": "{{gold}}",
                "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
            }
        else:
            longest = max(len(tokenizer.encode(it.answer)) for it in items)
            spec |= {
                "output_type": "generate_until",
                "doc_to_target": "{{answer}}",
                "generation_kwargs": {"until": [eos], "do_sample": False, "max_gen_toks": longest + 2},
                "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}],
            }
        text = yaml.safe_dump(spec, sort_keys=False, width=1000)
        if not items[0].choices:  # lm-eval's `!function` tag has no safe_dump form: written as text
            text += "process_results: !function utils.process_results\n"
        (out / f"{name}.yaml").write_text(text)
        names.append(PREFIX + name)
    return names


def run_lm_eval(
    root: RunRoot,
    spec: str,
    *,
    name: str,
    tasks: dict[str, list[TaskItem]] | None = None,
    task_dir: Path | None = None,
    task_names: list[str] | None = None,
    device: str = "cpu",
    batch_size: int = 16,
) -> dict[str, Any]:
    """Export checkpoint `spec`, score it with lm-eval on `tasks` (this package's) or on the YAMLs in
    `task_dir` (`task_names` of them, default all), write eval/lm-{name}.json; returns what was written."""
    from ddiloco.posttrain.export import export_model

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ddiloco-lm-eval-") as tmp:
        model_dir = Path(tmp) / "model"
        info = export_model(root, spec, str(model_dir))
        if task_dir is None:
            assert tasks is not None, "give tasks or a task_dir"
            task_dir = Path(tmp) / "tasks"
            names = write_task_dir(tasks, root.tokenizer(), task_dir)
        else:
            names = task_names or _defined_tasks(task_dir)
        out = _evaluate(model_dir, task_dir, names, device, batch_size)
    result = {
        "model": info.get("model", spec),
        "key": info.get("key"),
        "harness": "lm-eval",
        "lm_eval_version": _version(),
        "tasks": names,
        **{k: out[k] for k in KEPT if k in out},
        "seconds": time.monotonic() - t0,
    }
    result = json.loads(json.dumps(result, default=_plain))
    root.write_eval_result(f"lm-{name}", result)
    log.info("lm-eval on %s: %s (%.1fs)", spec, json.dumps(metrics_of(result)), result["seconds"])
    return result


def metrics_of(result: dict[str, Any]) -> dict[str, dict[str, float]]:
    """{task: {metric: value}} of lm-eval's results (stderr as `metric_stderr`), finite numbers only."""
    out: dict[str, dict[str, float]] = {}
    for task, values in (result.get("results") or {}).items():
        row = {}
        for key, v in values.items():
            metric = key.split(",")[0]
            if (
                "," in key
                and isinstance(v, int | float)
                and not isinstance(v, bool)
                and v == v
                and abs(v) != float("inf")
            ):
                row[metric] = float(v)
        out[task] = row
    return out


def _evaluate(model_dir: Path, task_dir: Path, names: list[str], device: str, batch_size: int) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    task_dir, model_dir = task_dir.resolve(), model_dir.resolve()  # both read after the chdir below
    manager = TaskManager(include_path=str(task_dir), include_defaults=False)
    unknown = sorted(set(names) - set(manager.all_tasks))
    if unknown:
        raise ValueError(f"lm-eval task(s) {unknown} are not defined in {task_dir}")
    with contextlib.chdir(task_dir):  # a YAML's relative `data_files` are the task directory's files
        return lm_eval.simple_evaluate(
            model="hf",
            model_args=f"pretrained={model_dir},dtype=float32",
            tasks=names,
            task_manager=manager,
            device=device,
            batch_size=batch_size,
            log_samples=False,
        )


def _defined_tasks(task_dir: Path) -> list[str]:
    """Task names the YAMLs of `task_dir` define (a `task:` key; groups and includes are lm-eval's)."""
    names = []
    for path in sorted(task_dir.rglob("*.yaml")):
        try:
            doc = _read_yaml(path.read_text())
        except yaml.YAMLError as e:
            raise ValueError(f"{path}: not a readable task YAML ({e})") from e
        if isinstance(doc, dict) and isinstance(doc.get("task"), str):
            names.append(doc["task"])
    if not names:
        raise ValueError(f"{task_dir} defines no lm-eval task (no YAML with a `task:` name)")
    return names


class _Tolerant(yaml.SafeLoader):
    """SafeLoader that reads lm-eval's `!function` tags as plain strings (only the task names are wanted)."""


_Tolerant.add_constructor("!function", lambda loader, node: loader.construct_scalar(node))


def _read_yaml(text: str) -> Any:
    """One YAML document through the safe loader above (what `yaml.safe_load` does, with `!function`)."""
    loader = _Tolerant(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def _version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("lm_eval")
    except PackageNotFoundError:
        return None


def _plain(value: Any) -> Any:
    """JSON for what lm-eval leaves in its output that JSON has no type for (numpy numbers, callables)."""
    if hasattr(value, "item"):
        return value.item()
    return str(value)
