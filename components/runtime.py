"""What a component body calls: run one `ddiloco` role in a child process and hand its results to KFP.

Design choices:
- Every component body is one call here, so the bodies carry no logic (DESIGN §3) and this code has tests.
- The role runs as `python -m ddiloco.cli ROLE ...` (the same command `ddiloco run` starts locally); its logs
  go to stderr and stream through, its result is the JSON object it prints as the last line of stdout.
- A failing role fails the component with the role's exit code in the message; the role has already said
  why on stderr (one line for anything a user can fix).
- Imports neither kfp nor torch: artifacts are duck-typed (`.path`, `.metadata`, `.log_metric`).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


class RoleFailed(RuntimeError):
    pass


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


def ddiloco(role: str, *args: Any, s3_endpoint: str = "", **flags: Any) -> dict[str, Any] | None:
    """Run a role to completion; return the JSON object it printed last on stdout (None if it printed none).
    `s3_endpoint` (host:port or URL) becomes DDILOCO_S3_ENDPOINT for the role; empty keeps the environment's."""
    env = dict(os.environ)
    if s3_endpoint:
        env["DDILOCO_S3_ENDPOINT"] = s3_endpoint
    cmd = command(role, *args, **flags)
    print("+ " + " ".join(cmd[1:]), file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env, check=False)
    sys.stdout.write(proc.stdout)
    sys.stdout.flush()
    if proc.returncode != 0:
        raise RoleFailed(
            f"`ddiloco {role}` exited with code {proc.returncode} (its error is in the log above)"
        )
    return last_json(proc.stdout)


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


def model_pointer(model: Any, store_url: str, key: str, meta: Mapping[str, Any] | None = None) -> None:
    """A KFP Model artifact for a checkpoint that stays in the run's store (models can be GBs): the artifact
    file is a small JSON pointer and the metadata carries the object's URL, so the UI lists the model."""
    pointer = {"uri": f"{store_url.rstrip('/')}/{key}", "format": "safetensors (ddiloco payload)"}
    for k, v in (meta or {}).items():
        if isinstance(v, str | int | float | bool):
            pointer[k] = v
    Path(model.path).parent.mkdir(parents=True, exist_ok=True)
    Path(model.path).write_text(json.dumps(pointer, indent=2, sort_keys=True))
    model.metadata.update(pointer)


def store_json(store_url: str, key: str, s3_endpoint: str = "") -> dict[str, Any] | None:
    """One small JSON object from the run's store (e.g. final/meta.json), or None."""
    if s3_endpoint:
        os.environ["DDILOCO_S3_ENDPOINT"] = s3_endpoint  # this component's own process only
    from ddiloco.store import open_store

    return open_store(store_url).get_json_or_none(key)


def publish_file(src: str | Path, artifact: Any) -> bool:
    """Copy a file a role wrote (report.html, report.md) into a KFP artifact; False if the role wrote none."""
    if not Path(src).is_file():
        print(f"warning: {src} was not written; the artifact stays empty", file=sys.stderr)
        return False
    Path(artifact.path).parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, artifact.path)
    return True


def prepare_settings(
    overrides: Sequence[str], learners: int, quorum: int, token_budget: int, chaos: str, max_learners: int
) -> list[str]:
    """The `--set` list of the prepare step: the UI's overrides, then the UI's headline knobs (which win)."""
    if not 1 <= learners <= max_learners:
        raise ValueError(
            f"learners={learners}: this pipeline was compiled for 1..{max_learners} concurrent learners; "
            "recompile with `ddiloco pipeline compile --max-learners N` for more"
        )
    bad = [o for o in overrides if not isinstance(o, str) or "=" not in o]
    if bad:
        raise ValueError(f"overrides must be strings like 'diloco.codec=int4', got {bad}")
    out = [*overrides, f"diloco.learners={learners}"]
    if quorum > 0:
        out.append(f"diloco.quorum={quorum}")
    if token_budget > 0:
        out.append(f"diloco.token_budget={token_budget}")
    if chaos.strip():
        out.append(f"chaos={chaos.strip()}")
    return out


def join_slots(store_url: str, learners: int, max_learners: int, s3_endpoint: str = "") -> list[int]:
    """The slots of the `join` pipeline's learners, after checking that this cluster (its endpoint and
    credentials) can read a prepared run at `store_url`: a wrong root or key fails here, in one step."""
    if not 1 <= learners <= max_learners:
        raise ValueError(
            f"learners={learners}: this pipeline was compiled for 1..{max_learners} concurrent learners; "
            "recompile with `ddiloco pipeline compile --pipeline join --max-learners N` for more"
        )
    if store_json(store_url, "config.json", s3_endpoint) is None:  # ddiloco.wire.CONFIG
        raise ValueError(
            f"no run at {store_url} (no config.json): give the run root of a running run, "
            "s3://BUCKET/PREFIX/RUN_ID (its pretrain pipeline's KFP run id), readable with this cluster's Secret"
        )
    return list(range(learners))


def join_name(run_tag: str, slot: int) -> str:
    """A joined learner's stable name: a retried pod of the same slot takes its learner id back."""
    return f"{run_tag}-{slot}"


def store_model(model: Any, store_url: str, which: str, s3_endpoint: str = "") -> None:
    """Model artifact for the run's `final` or `sft` checkpoint (see `model_pointer`)."""
    if which == "final":
        key, meta_key = "final/model.safetensors", "final/meta.json"  # ddiloco.wire.FINAL_MODEL / FINAL_META
    elif which == "sft":
        key, meta_key = "sft/model.safetensors", "sft/meta.json"  # ddiloco.evaluate.SFT_MODEL / SFT_META
    else:
        raise ValueError(f"unknown checkpoint {which!r}; use final or sft")
    meta = store_json(store_url, meta_key, s3_endpoint) or {}
    model_pointer(model, store_url, key, {"checkpoint": which, "present": bool(meta), **meta})


def run_report(store_url: str, html: Any, markdown: Any, summary: Any, s3_endpoint: str = "") -> None:
    """`ddiloco report RUN --out DIR` (ddiloco/report.py writes report.html, summary.md, metrics.json there),
    then report.html -> HTML, summary.md -> Markdown and the flat metrics.json -> Metrics."""
    out = Path(html.path).parent / "ddiloco-report"
    printed = ddiloco("report", store_url, out=out, s3_endpoint=s3_endpoint)
    publish_file(out / "report.html", html)
    publish_file(out / "summary.md", markdown)
    written = out / "metrics.json"
    log_metrics(summary, json.loads(written.read_text()) if written.is_file() else printed)
