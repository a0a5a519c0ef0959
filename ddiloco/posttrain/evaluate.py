"""Evaluation of a model from the store: validation loss, perplexity and downstream task accuracy.

Design choices:
- Fixed, non-overlapping validation windows (deterministic, identical for every model of a run) so losses
  are comparable across the initial, final and fine-tuned checkpoints and the post-hoc curve.
- Any checkpoint in the store can be evaluated (`load_model`): `final`, `latest` (newest global version of
  every fragment), `sft`, `round:N` (the global model right after round N merged, while retention keeps its versions),
  `learner:ID` (a learner's latest checkpoint, when it holds parameters: checkpoints this version writes
  hold none), or the key of any payload holding every parameter (named `name` or `param/name`).
- Tasks come from the run's own data: the synthetic world (`tasks.synthetic_tasks`) for the built-in corpus,
  cloze multiple choice from the validation split for user corpora. Deterministic given `EvalTasksConfig.seed`.
- Results are JSON under `eval/` so reports and reruns read them instead of recomputing.
- Everything is read through a `ddiloco.run.root.RunRoot`, so with the run key every model and the validation
  split must verify; a model signed with another key, or unsigned, is refused (one line: which key to set).
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import torch

from ddiloco import keys
from ddiloco.config.run import EvalConfig
from ddiloco.data.loader import val_batches
from ddiloco.data.synthetic import make_world
from ddiloco.data.tokenizer import Tokenizer
from ddiloco.model.gpt import GPT
from ddiloco.platform.devices import resolve_device
from ddiloco.posttrain.summary import read_round_records
from ddiloco.posttrain.tasks import TaskItem, cloze_tasks, evaluate_tasks, synthetic_tasks
from ddiloco.posttrain.tracked import track_curve, track_eval
from ddiloco.protocol import wire
from ddiloco.run.globalmodel import Layout
from ddiloco.run.root import RunRoot
from ddiloco.store.base import NotFound
from ddiloco.tracking.tracker import OFF, Tracker

log = logging.getLogger(__name__)

EvalTasksConfig = EvalConfig  # the `eval:` section of the run config


@torch.no_grad()
def validation_loss(
    model: GPT, val_tokens: torch.Tensor, *, batch_size: int, seq_len: int, max_batches: int
) -> float:
    """Mean token cross-entropy (nats) over the first `max_batches` validation windows."""
    model.eval()
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for x, y in val_batches(val_tokens, batch_size=batch_size, seq_len=seq_len, max_batches=max_batches):
        _, loss = model(x.to(device), y.to(device))
        total += float(loss) * y.numel()
        count += y.numel()
    model.train()
    if count == 0:
        raise ValueError("the validation split is shorter than one batch; raise data.val_fraction")
    return total / count


def run_validation_loss(model: GPT, val_tokens: torch.Tensor, cfg: Any) -> float:
    """`validation_loss` with a run's settings: its batch size, sequence length and `eval.val_batches`, so
    every evaluation of a run (final, curve, baseline, a round) reads the same windows."""
    return validation_loss(
        model,
        val_tokens,
        batch_size=cfg.train.batch_size,
        seq_len=cfg.model.seq_len,
        max_batches=cfg.eval.val_batches,
    )


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0))


# --- models in the store -------------------------------------------------------------------------------------
MODEL_SPECS = "final, latest, sft, round:N, learner:ID or a payload key"


def versions_after_round(records: list[dict[str, Any]], round_: int, num_fragments: int) -> list[int]:
    """Global version of every fragment right after round `round_` merged (0 for fragments not yet merged)."""
    versions = [0] * num_fragments
    for rec in records:
        if rec["round"] <= round_:
            versions[rec["fragment_id"]] = max(versions[rec["fragment_id"]], rec["version"])
    return versions


def load_model(root: RunRoot, spec: str, layout: Layout) -> tuple[GPT, dict[str, Any]]:
    """(model, description) for `final`, `latest`, `sft`, `round:N`, `learner:ID` or a payload key."""
    if spec == "final":
        return root.final_model(layout), {"model": "final", "key": keys.FINAL_MODEL}
    if spec == "latest":
        versions = root.latest_versions(layout)
        return root.model_at_versions(layout, versions), {"model": "latest", "versions": versions}
    if spec.startswith(("round:", "learner:")) and not spec.split(":", 1)[1].isdigit():
        raise ValueError(f"bad model {spec!r}: use {MODEL_SPECS}")
    if spec.startswith("round:"):
        records = read_round_records(root.store)
        versions = versions_after_round(records, int(spec.split(":", 1)[1]), layout.num_fragments)
        try:
            return root.model_at_versions(layout, versions), {"model": spec, "versions": versions}
        except NotFound as e:
            raise NotFound(
                f"{spec}: versions {versions} are no longer all in the store ({e}); the run keeps the latest "
                "and the loss curve's versions (`retention`, listed in syncer/retention.json)"
            ) from None
    kind = None  # a payload at a key the user gives: any kind the syncer signs
    if spec == "sft":
        key, kind = keys.SFT_MODEL, "sft"
    elif spec.startswith("learner:"):
        key, kind = root.learner_checkpoint_key(int(spec.split(":", 1)[1])), "learner_ckpt"
    else:
        key = spec
    try:
        model, meta = root.payload_model(key, layout, kind=kind)
    except NotFound:
        hint = "; run `ddiloco sft` first" if spec == "sft" else ""
        raise NotFound(f"no checkpoint at {root.url}/{key}{hint}") from None
    except wire.PayloadError as e:
        if not spec.startswith("learner:") or e.reason != "wrong_shape":
            raise
        raise ValueError(
            f"{spec}: learner checkpoints hold only AdamW state and the data cursor (a rejoining learner takes "
            "its parameters from the globals); evaluate `latest` instead"
        ) from None
    return model, {"model": spec, "key": key, "kind": meta.get("kind")}


# --- tasks ---------------------------------------------------------------------------------------------------
def split_documents(tokens: torch.Tensor, eos_id: int) -> list[list[int]]:
    docs, cur = [], []
    for t in tokens.tolist():
        if t == eos_id:
            if cur:
                docs.append(cur)
            cur = []
        else:
            cur.append(t)
    if cur:
        docs.append(cur)
    return docs


def build_tasks(
    root: RunRoot, cfg: Any, tokenizer: Tokenizer, val: torch.Tensor, ecfg: EvalTasksConfig
) -> dict[str, list[TaskItem]]:
    """The run's task suite: the synthetic world's probes, or cloze items from the validation text."""
    seed = cfg.seed if ecfg.seed is None else ecfg.seed
    meta = root.data_meta() or {}
    if cfg.data.source == "synthetic":
        world = make_world(meta.get("world_seed", cfg.seed), n_entities=cfg.data.synthetic_entities)
        tasks = synthetic_tasks(world, seed, ecfg.items_per_task)
    else:
        texts = [tokenizer.decode(d) for d in split_documents(val, tokenizer.eos_id)]
        tasks = cloze_tasks(texts, seed, ecfg.items_per_task)
    if ecfg.tasks is not None:
        unknown = set(ecfg.tasks) - set(tasks)
        if unknown:
            raise ValueError(f"unknown task(s) {sorted(unknown)}; this run has {sorted(tasks)}")
        tasks = {k: v for k, v in tasks.items() if k in ecfg.tasks}
    return tasks


def evaluate_model(
    model: GPT,
    *,
    cfg: Any,
    val: torch.Tensor,
    tokenizer: Tokenizer,
    tasks: dict[str, list[TaskItem]],
) -> dict[str, Any]:
    """Validation loss, perplexity and per-task accuracy of one model."""
    loss = run_validation_loss(model, val, cfg)
    results = evaluate_tasks(model, tokenizer, tasks)
    return {
        "val_loss": loss,
        "perplexity": perplexity(loss),
        "tasks": results,
        "task_accuracy": {k: v["accuracy"] for k, v in results.items()},
    }


def evaluate_checkpoint(
    root: RunRoot,
    spec: str = "final",
    *,
    name: str | None = None,
    ecfg: EvalTasksConfig | None = None,
    tracker: Tracker = OFF,
) -> dict[str, Any]:
    """Evaluate one checkpoint of the run and write the result to eval/{name}.json."""
    ecfg = ecfg or EvalTasksConfig()
    t0 = time.monotonic()
    cfg = root.config()
    layout = root.layout()
    tokenizer = root.tokenizer()
    val = root.val()
    model, info = load_model(root, spec, layout)
    model.to(resolve_device(ecfg.device))
    tasks = build_tasks(root, cfg, tokenizer, val, ecfg)
    result = {
        "run_id": cfg.run_id,
        **info,
        **evaluate_model(model, cfg=cfg, val=val, tokenizer=tokenizer, tasks=tasks),
        "seed": cfg.seed if ecfg.seed is None else ecfg.seed,
        "seconds": time.monotonic() - t0,
    }
    name = name or spec.replace(":", "-").replace("/", "_")
    root.write_eval_result(name, result)
    track_eval(tracker, root, name, result)
    log.info(
        "evaluated %s: val loss %.4f, %s (%.1fs)",
        spec,
        result["val_loss"],
        ", ".join(f"{k} {v:.2f}" for k, v in result["task_accuracy"].items()),
        result["seconds"],
    )
    return result


# --- the global model over time (reports) --------------------------------------------------------------------
def curve_points(
    records: list[dict[str, Any]], num_fragments: int, points: int, available: list[set[int]] | None = None
) -> list[dict[str, Any]]:
    """Snapshots evenly spaced in merged rounds: the versions, merge time and tokens merged by then.

    The first point is global version 0 of every fragment (before any merge); tokens merged are summed over
    the merged answers' c_tokens and divided by the number of fragments, as in the summary's ledger.
    `available`: per fragment, the global versions still in the store (retention prunes the others,
    `ddiloco.config.retention`); only moments whose every version is available are drawn, each target moment
    replaced by the nearest available one (the run's start and end always are).
    """
    records = sorted(records, key=lambda r: r["merged_at"])
    start = min((r["opened_at"] for r in records), default=0.0)
    versions, tokens = [0] * num_fragments, 0.0
    cumulative = [{"round": None, "time": start, "tokens_merged": 0.0, "versions": list(versions)}]
    for r in records:
        versions[r["fragment_id"]] = max(versions[r["fragment_id"]], r["version"])
        tokens += sum(c["c_tokens"] for c in r["contributors"].values()) / num_fragments
        cumulative.append(
            {"round": r["round"], "time": r["merged_at"], "tokens_merged": tokens, "versions": list(versions)}
        )
    usable = [
        i
        for i, snap in enumerate(cumulative)
        if available is None or all(v in available[p] for p, v in enumerate(snap["versions"]))
    ]
    if len(usable) <= points:
        return [cumulative[i] for i in usable]
    targets = [i * (len(cumulative) - 1) / (points - 1) for i in range(points)]
    picks = sorted({min(usable, key=lambda i, t=t: (abs(i - t), i)) for t in targets})
    return [cumulative[i] for i in picks]


def global_loss_curve(
    root: RunRoot,
    points: int = 8,
    *,
    records: list[dict[str, Any]] | None = None,
    refresh: bool = False,
    tracker: Tracker = OFF,
) -> list[dict[str, Any]]:
    """Validation loss of the global model at `points` moments of the run; cached at eval/curve.json and
    recomputed when more rounds have merged since (a report of a running run) or with refresh. A curve
    computed here is logged to `tracker` (`global/val_loss` at tokens merged); a cached one was already."""
    if records is None:
        records = read_round_records(root.store)
    cached = None if refresh else root.document(keys.EVAL_CURVE)
    if (
        cached is not None
        and cached.get("points_requested") == points
        and cached.get("rounds") == len(records)
    ):
        return cached["points"]
    cfg = root.config()
    layout = root.layout()
    val = root.val()
    available = keys.global_versions_listed(root.store.list(keys.GLOBALS), layout.num_fragments)
    snaps = curve_points(records, layout.num_fragments, max(points, 2), available)
    for snap in snaps:
        model = root.model_at_versions(layout, snap["versions"])
        snap["val_loss"] = run_validation_loss(model, val, cfg)
    root.write_document(
        keys.EVAL_CURVE, {"points_requested": points, "rounds": len(records), "points": snaps}
    )
    track_curve(tracker, snaps)
    return snaps
