"""What a component body calls: run one `ddiloco` role in a child process and hand its results to KFP.

Every component body is one call here, so the bodies KFP embeds carry no logic and this code has tests. The
role runs as `python -m ddiloco.cli ROLE ...` (the command `ddiloco run` starts locally); its logs stream
through stderr, and its result is the JSON object it prints as the last line of stdout. A failing role fails
the component with its exit code. The run root is joined here from the store base and the run id, because
KFP 2.17 resolves `{{$.pipeline_job_uuid}}` only as a parameter's whole value. Without keepers
(`keeper=False`) a crashed long-running role is restarted in its pod, exit code 2 never. Imports neither kfp
nor torch: artifacts are duck-typed.

Design notes: docs/internals.md, "Component bodies".
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ddiloco.components import params

from ddiloco import keys

NAMESPACE_ENV = "DDILOCO_K8S_NAMESPACE"
"""The pod's namespace (the pipeline sets it from the downward API `metadata.namespace`)."""
USAGE_ERROR = 2
"""`ddiloco` exits 2 for a mistake its one-line message explains: restarting cannot help."""


class RoleFailed(RuntimeError):
    pass


def run_root(store: str, run_id: str = "") -> str:
    """The run root `{store}/{run_id}` (`store` alone when run_id is empty), `{namespace}` in `store` replaced
    by the pod's namespace. Refuses what a real backend would leave unresolved."""
    for name, value in (("store", store), ("run_id", run_id)):
        if "{{" in value:
            raise ValueError(
                f"{name}={value!r} holds an unresolved KFP placeholder: KFP replaces `{{{{$.pipeline_job_uuid}}}}` "
                "only as a parameter's whole value. Recompile the pipeline with this ddiloco version "
                "(`ddiloco pipeline compile`) and upload it again"
            )
    if "{namespace}" in store:
        namespace = os.environ.get(NAMESPACE_ENV, "")
        if not namespace:
            raise ValueError(
                f"store {store!r} contains {{namespace}} but {NAMESPACE_ENV} is not set (the pipeline sets it "
                "from the pod's namespace); outside a pipeline, write the namespace into the prefix"
            )
        store = store.replace("{namespace}", namespace)
    if not run_id:
        return store
    if "/" in run_id or run_id.strip(".") == "" or run_id != run_id.strip():
        raise ValueError(f"run_id {run_id!r} must be one path segment (a KFP run id, e.g. 3f2a…)")
    return f"{store.rstrip('/')}/{run_id}"


def command(role: str, *args: Any, **flags: Any) -> list[str]:
    """`ddiloco ROLE args --flag value ...`; None/False flags are left out, True is a bare switch, a list
    repeats the flag (`set=["a=1", "b=2"]` -> `--set a=1 --set b=2`)."""
    cmd = [sys.executable, "-m", "ddiloco.cli", role, *(str(a) for a in args)]
    for key, value in flags.items():
        flag = "--" + key.replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            cmd.append(flag)
        elif isinstance(value, list | tuple):
            for item in value:
                cmd += [flag, str(item)]
        else:
            cmd += [flag, str(value)]
    return cmd


def ddiloco(
    role: str,
    *args: Any,
    s3_endpoint: str = "",
    restarts: int = 0,
    restart_delay_s: float = 10.0,
    env: Mapping[str, str] | None = None,
    **flags: Any,
) -> dict[str, Any] | None:
    """Run a role to completion; return the JSON object it printed last on stdout (None if it printed none).
    `s3_endpoint` (host:port or URL) becomes DDILOCO_S3_ENDPOINT for the role; empty keeps the environment's;
    `env`: more variables for the role (e.g. HF_DATASETS_CACHE).
    A crash (any exit but 0 and 2, or a signal) is restarted up to `restarts` times after `restart_delay_s`:
    the role comes back as a new incarnation from its checkpoint in the store, as after a pod retry."""
    env = {**os.environ, **(env or {})}
    if s3_endpoint:
        env["DDILOCO_S3_ENDPOINT"] = s3_endpoint
    cmd = command(role, *args, **flags)
    for attempt in range(restarts + 1):
        print("+ " + " ".join(cmd[1:]), file=sys.stderr, flush=True)
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env, check=False)
        sys.stdout.write(proc.stdout)
        sys.stdout.flush()
        if proc.returncode == 0:
            return last_json(proc.stdout)
        if proc.returncode == USAGE_ERROR or attempt == restarts:
            break
        print(
            f"`ddiloco {role}` exited with code {proc.returncode}; restart {attempt + 1} of {restarts} "
            f"in {restart_delay_s:g} s",
            file=sys.stderr,
            flush=True,
        )
        time.sleep(restart_delay_s)
    raise RoleFailed(f"`ddiloco {role}` exited with code {proc.returncode} (its error is in the log above)")


def last_json(stdout: str) -> dict[str, Any] | None:
    for line in reversed(stdout.strip().splitlines()):
        try:
            value = json.loads(line)
        except ValueError:
            continue
        return value if isinstance(value, dict) else None
    return None


def flat_numbers(result: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """Finite numbers of a (nested) result, with dotted names: {"task_accuracy": {"qa": 0.5}} -> task_accuracy.qa."""
    out: dict[str, float] = {}
    for key, value in result.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flat_numbers(value, name + "."))
        elif isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            out[name] = float(value)
    return out


def log_metrics(metrics: Any, result: Mapping[str, Any] | None, keys: Sequence[str] | None = None) -> None:
    """Log a role's numbers as KFP scalar metrics (all of them, or the top-level `keys` only)."""
    if result is None:
        return
    if keys is not None:
        result = {k: result[k] for k in keys if k in result}
    for name, value in sorted(flat_numbers(result).items()):
        metrics.log_metric(name, value)


def open_run_store(store_url: str, s3_endpoint: str = "") -> Any:
    """The run's store, opened in this component's process (`s3_endpoint` as DDILOCO_S3_ENDPOINT)."""
    if s3_endpoint:
        os.environ["DDILOCO_S3_ENDPOINT"] = s3_endpoint  # this component's own process only
    from ddiloco.store.url import open_store

    return open_store(store_url)


def store_json(store_url: str, key: str, s3_endpoint: str = "") -> dict[str, Any] | None:
    """One small JSON object from the run's store (e.g. final/meta.json), or None."""
    return open_run_store(store_url, s3_endpoint).get_json_or_none(key)


def publish_file(src: str | Path, artifact: Any) -> bool:
    """Copy a file a role wrote (report.html, report.md) into a KFP artifact; False if the role wrote none."""
    if not Path(src).is_file():
        print(f"warning: {src} was not written; the artifact stays empty", file=sys.stderr)
        return False
    Path(artifact.path).parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, artifact.path)
    return True


def prepare_settings(inputs: Mapping[str, Any]) -> list[str]:
    """The `--set` list of the prepare step, from its inputs by name: one shard per learner id up to the
    pipeline's `max_learners` (learners joined mid-run read data of their own; an override of
    diloco.max_learners wins), `learner_ranks` > 1 as train.ranks, the UI's `overrides`, then the config key
    of each run parameter that has one (`ddiloco.components.params`: learners, quorum, model_hf, corpus, ...)
    whose input is not empty, which win over the overrides."""
    learners, max_learners = int(inputs.get("learners", 1)), int(inputs["max_learners"])
    if not 1 <= learners <= max_learners:
        raise ValueError(
            f"learners={learners}: this pipeline was compiled for 1..{max_learners} concurrent learners; "
            "recompile with `ddiloco pipeline compile --max-learners N` for more"
        )
    overrides = inputs.get("overrides") or []
    bad = [o for o in overrides if not isinstance(o, str) or "=" not in o]
    if bad:
        raise ValueError(f"overrides must be strings like 'diloco.codec=int4', got {bad}")
    out = [f"diloco.max_learners={max_learners}"]
    if int(inputs.get("learner_ranks", 1)) > 1:
        out.append(f"train.ranks={int(inputs['learner_ranks'])}")
    out += overrides
    for param in params.configured():
        value = inputs.get(param.name)
        value = None if value is None else param.type(value)
        if isinstance(value, str):
            value = value.strip()
        if value:
            out.append(f"{param.config}={value}")
    return out


def check_run(values: Mapping[str, Any], max_learners: int, learner_ranks: int = 1) -> None:
    """The config the prepare step would build from these run parameters (recipe, overrides and those with a
    config key) is valid: `prepare_settings`, then the recipe loaded with them, which refuses an unknown key
    with a did-you-mean (`ddiloco.config.overrides.apply_dict`); and the placement parameters among `values`
    (`ddiloco.components.clusterparams`). Used where the parameters are given (`ddiloco pipeline compile |
    submit | schedule`) and by a run's first step, for runs started from the KFP UI. No `recipe`: the
    placement parameters only."""
    from ddiloco.components.clusterparams import check_placement

    from ddiloco.config.recipes import load_config
    from ddiloco.errors import ConfigError

    check_placement(values)
    if "recipe" not in values:
        return
    overrides = values.get("overrides") or []
    if not isinstance(overrides, list):
        raise ConfigError(f"parameter overrides={overrides!r} must be a list of key=value strings")
    limits = {"max_learners": max_learners, "learner_ranks": learner_ranks}
    settings = prepare_settings({**values, "overrides": overrides, **limits})
    try:
        load_config(str(values["recipe"]), overrides=settings)
    except ConfigError as e:
        raise ConfigError(f"the run parameters do not make a valid run config: {e}") from None


def tokenize_plan(inputs: Mapping[str, Any]) -> tuple[list[int], str, bool]:
    """The tokenize-plan step, the run's first, from its inputs by name: (units to tokenize, the corpus URL
    prepare will read, whether it is tokenized here). With a `recipe`, the run parameters among the inputs
    and the pipeline's max_learners / learner_ranks are checked first (`check_run`), so a run started from
    the KFP UI with a misspelt override fails here, in seconds, not at prepare after tokenizing. Text
    (`text_corpus`): `ddiloco tokenize --stage plan` under `{store}/corpora` (no units when an earlier run
    tokenized the same text); a pre-tokenized `corpus`: passed on; neither: "" (the recipe's data)."""
    text_corpus, corpus = str(inputs.get("text_corpus", "")), str(inputs.get("corpus", ""))
    model_hf, s3_endpoint = str(inputs.get("model_hf", "")), str(inputs.get("s3_endpoint", ""))
    if inputs.get("recipe"):
        limits = {k: int(inputs.get(k, 1)) for k in ("max_learners", "learner_ranks")}
        check_run(inputs, **limits)
    if text_corpus.strip() and corpus.strip():
        raise ValueError("give text_corpus (to tokenize) or corpus (already tokenized), not both")
    if not text_corpus.strip():
        return [], corpus.strip(), False
    printed = ddiloco(
        "tokenize",
        stage="plan",
        input=text_corpus.strip(),
        out=f"{run_root(str(inputs['store'])).rstrip('/')}/corpora",
        tokenizer="auto",
        model_hf=model_hf.strip() or None,
        s3_endpoint=s3_endpoint,
    )
    if not printed or not printed.get("url"):
        raise RoleFailed("`ddiloco tokenize --stage plan` printed no corpus URL")
    return [int(u) for u in printed["units"]], str(printed["url"]), True


def tokenize_finish(corpus: str, tokenized: bool, s3_endpoint: str = "") -> str:
    """The tokenize-finish step, after every unit: the manifest of a corpus tokenized here; the URL."""
    if tokenized:
        ddiloco("tokenize", stage="finish", corpus=corpus, s3_endpoint=s3_endpoint)
    return corpus


def join_slots(store_url: str, learners: int, max_learners: int, s3_endpoint: str = "") -> list[int]:
    """The slots of the `join` pipeline's learners, after checking that this cluster (its endpoint and
    credentials) can read a prepared run at `store_url`: a wrong root or key fails here, in one step."""
    if not 1 <= learners <= max_learners:
        raise ValueError(
            f"learners={learners}: this pipeline was compiled for 1..{max_learners} concurrent learners; "
            "recompile with `ddiloco pipeline compile --pipeline join --max-learners N` for more"
        )
    if store_json(store_url, keys.CONFIG, s3_endpoint) is None:
        raise ValueError(
            f"no run at {store_url} (no {keys.CONFIG}): give the run root of a running run, "
            "s3://BUCKET/PREFIX/RUN_ID (its pretrain pipeline's KFP run id), readable with this cluster's Secret"
        )
    return list(range(learners))


def join_name(run_tag: str, slot: int) -> str:
    """A joined learner's stable name: a retried pod of the same slot takes its learner id back."""
    return f"{run_tag}-{slot}"


def run_report(store_url: str, html: Any, markdown: Any, summary: Any, s3_endpoint: str = "") -> None:
    """`ddiloco report RUN --out DIR` (ddiloco/report.py writes report.html, summary.md, metrics.json there),
    then report.html -> HTML, summary.md -> Markdown and the flat metrics.json -> Metrics. The report step is
    the pipeline's exit handler: when the run failed before there was anything to report (no config, or a
    report the partial run cannot give), it still writes both artifacts, saying how far the run got."""
    out = Path(html.path).parent / "ddiloco-report"
    try:
        printed = ddiloco("report", store_url, out=out, s3_endpoint=s3_endpoint)
    except RoleFailed as e:
        write_incomplete_report(store_url, html, markdown, summary, str(e), s3_endpoint)
        return
    publish_file(out / "report.html", html)
    publish_file(out / "summary.md", markdown)
    written = out / "metrics.json"
    log_metrics(summary, json.loads(written.read_text()) if written.is_file() else printed)


RUN_MARKERS = (
    (keys.CONFIG, "prepared (config.json)"),
    (keys.STATUS, "syncer started (status.json)"),
    (keys.DONE, "token budget merged (done.json)"),
    (keys.FINAL_META, "final model written"),
    (keys.eval_key("final"), "final model evaluated"),
    (keys.SFT_META, "fine-tuned"),
    (keys.eval_key("sft"), "fine-tuned model evaluated"),
)
"""Objects of the run root that say how far a run got."""


def write_incomplete_report(
    store_url: str, html: Any, markdown: Any, summary: Any, why: str, s3_endpoint: str = ""
) -> None:
    """HTML + Markdown for a run the full report cannot describe (it failed or was stopped early)."""
    try:
        store = open_run_store(store_url, s3_endpoint)
        present = [(label, store.exists(key)) for key, label in RUN_MARKERS]
        reached = ""
    except Exception as e:  # noqa: BLE001 (the store itself may be what failed the run)
        present, reached = [], f"The run's store could not be read: {e}"
    done = sum(ok for _, ok in present)
    rows = "".join(f"| {label} | {'yes' if ok else 'no'} |\n" for label, ok in present)
    md = (
        f"# ddiloco run at {store_url}: incomplete\n\nThe full report could not be made: {why}.\n\n"
        + (f"{reached}\n" if reached else f"| stage | reached |\n|---|---|\n{rows}")
        + "\nThe run's logs are in each step's pod logs in the KFP UI; `ddiloco summary --store "
        f"{store_url}` shows its token ledger from any machine that reaches the store.\n"
    )
    items = "".join(f"<tr><td>{label}</td><td>{'yes' if ok else 'no'}</td></tr>" for label, ok in present)
    page = (
        f"<!doctype html><html><head><meta charset='utf-8'><title>ddiloco run (incomplete)</title></head><body>"
        f"<h1>ddiloco run: incomplete</h1><p>{_escape(store_url)}</p><p>The full report could not be made: "
        f"{_escape(why)}.</p>{_escape(reached)}<table><tr><th>stage</th><th>reached</th></tr>{items}</table>"
        "</body></html>"
    )
    for artifact, text in ((html, page), (markdown, md)):
        Path(artifact.path).parent.mkdir(parents=True, exist_ok=True)
        Path(artifact.path).write_text(text)
    summary.log_metric("run_complete", 0.0)
    summary.log_metric("stages_reached", float(done))


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
