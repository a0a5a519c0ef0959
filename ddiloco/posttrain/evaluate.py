"""Evaluation of a model from the store: validation loss, perplexity and downstream task accuracy.

Design choices:
- Fixed, non-overlapping validation windows (deterministic, identical for every model of a run) so losses
  are comparable across the initial, final and fine-tuned checkpoints and the post-hoc curve.
- Any checkpoint in the store can be evaluated (`load_model`): `final`, `latest` (newest global version of
  every fragment), `sft`, `round:N` (the global model right after round N merged), `learner:ID` (a learner's
  latest checkpoint), or the key of any payload holding every parameter (named `name` or `param/name`).
- Tasks come from the run's own data: the synthetic world (`tasks.synthetic_tasks`) for the built-in corpus,
  cloze multiple choice from the validation split for user corpora. Deterministic given `EvalTasksConfig.seed`.
- Results are JSON under `eval/` so reports and reruns read them instead of recomputing.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import torch

from ddiloco import keys
from ddiloco.config import EvalConfig
from ddiloco.data import val_batches
from ddiloco.globalmodel import (
    MAX_FRAGMENT_BYTES,
    Layout,
    build_model,
    load_final_model,
    load_latest_model,
    read_global,
    read_layout,
)
from ddiloco.model import GPT
from ddiloco.posttrain.tasks import TaskItem, cloze_tasks, evaluate_tasks, synthetic_tasks
from ddiloco.protocol import wire
from ddiloco.store import NotFound, Store
from ddiloco.synthetic import make_world
from ddiloco.tokenizer import Tokenizer, tokenizer_from_json

log = logging.getLogger(__name__)

# Keys this module (and sft.py / report.py) add under the run root.
SFT_MODEL = "sft/model.safetensors"
SFT_META = "sft/meta.json"
EVAL_CURVE = "eval/curve.json"
MAX_TOKENIZER_BYTES = 256 << 20  # a BPE vocabulary of a few 100k merges is tens of MB


def eval_key(name: str) -> str:
    return f"eval/{name}.json"


EvalTasksConfig = EvalConfig  # the `eval:` section of the run config


def resolve_device(spec: str) -> torch.device:
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(spec)


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


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0))


# --- models in the store -------------------------------------------------------------------------------------
def model_from_payload(layout: Layout, blob: bytes, *, run_id: str, key: str) -> tuple[GPT, dict[str, Any]]:
    """A model from any payload that holds every parameter, named `name` or `param/name`."""
    payload = wire.unpack(blob, expect={"run_id": run_id})
    model = build_model(layout)
    with torch.no_grad():
        for n, p in model.named_parameters():
            t = payload.tensors.get(n, payload.tensors.get(f"param/{n}"))
            if t is None or t.shape != p.shape:
                raise wire.PayloadError("wrong_shape", f"{key} is missing or mis-shapes parameter {n}")
            p.copy_(t.float())
    return model, payload.meta


def versions_after_round(store: Store, round_: int, num_fragments: int) -> list[int]:
    """Global version of every fragment right after round `round_` merged (0 for fragments not yet merged)."""
    versions = [0] * num_fragments
    for rec in (store.get_json(k) for k in store.list("syncer/rounds/")):
        if rec["round"] <= round_:
            versions[rec["fragment_id"]] = max(versions[rec["fragment_id"]], rec["version"])
    return versions


def model_at_versions(store: Store, run_id: str, layout: Layout, versions: list[int]) -> GPT:
    model = build_model(layout)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for frag, v in zip(layout.fragments, versions, strict=True):
            for n, t in read_global(store, run_id, layout, frag.fragment_id, v).items():
                params[n].copy_(t)
    return model


def load_model(store: Store, spec: str, run_id: str, layout: Layout) -> tuple[GPT, dict[str, Any]]:
    """(model, description) for `final`, `latest`, `sft`, `round:N`, `learner:ID` or a payload key."""
    if spec == "final":
        return load_final_model(store, run_id, layout), {"model": "final", "key": keys.FINAL_MODEL}
    if spec == "latest":
        model, versions = load_latest_model(store, run_id, layout)
        return model, {"model": "latest", "versions": versions}
    if spec.startswith(("round:", "learner:")) and not spec.split(":", 1)[1].isdigit():
        raise ValueError(f"bad model {spec!r}: use final, latest, sft, round:N, learner:ID or a payload key")
    if spec.startswith("round:"):
        versions = versions_after_round(store, int(spec.split(":", 1)[1]), layout.num_fragments)
        return model_at_versions(store, run_id, layout, versions), {"model": spec, "versions": versions}
    if spec == "sft":
        key = SFT_MODEL
    elif spec.startswith("learner:"):
        pointer = store.get_json_or_none(keys.ckpt_latest_key(int(spec.split(":", 1)[1])))
        if pointer is None:
            raise NotFound(f"learner {spec.split(':', 1)[1]} has no checkpoint in {store.url}")
        key = pointer["key"]
    else:
        key = spec
    try:
        blob = store.get(key, max_bytes=MAX_FRAGMENT_BYTES * 4)
    except NotFound:
        hint = "; run `ddiloco sft` first" if spec == "sft" else ""
        raise NotFound(f"no checkpoint at {store.url}/{key}{hint}") from None
    model, meta = model_from_payload(layout, blob, run_id=run_id, key=key)
    return model, {"model": spec, "key": key, "kind": meta.get("kind")}


def load_tokenizer(store: Store) -> Tokenizer:
    return tokenizer_from_json(store.get(keys.TOKENIZER, max_bytes=MAX_TOKENIZER_BYTES).decode())


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
    store: Store, cfg: Any, tokenizer: Tokenizer, val: torch.Tensor, ecfg: EvalTasksConfig
) -> dict[str, list[TaskItem]]:
    """The run's task suite: the synthetic world's probes, or cloze items from the validation text."""
    seed = cfg.seed if ecfg.seed is None else ecfg.seed
    meta = store.get_json_or_none(keys.DATA_META) or {}
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
    loss = validation_loss(
        model,
        val,
        batch_size=cfg.train.batch_size,
        seq_len=cfg.model.seq_len,
        max_batches=cfg.eval.val_batches,
    )
    results = evaluate_tasks(model, tokenizer, tasks)
    return {
        "val_loss": loss,
        "perplexity": perplexity(loss),
        "tasks": results,
        "task_accuracy": {k: v["accuracy"] for k, v in results.items()},
    }


def evaluate_checkpoint(
    store: Store, spec: str = "final", *, name: str | None = None, ecfg: EvalTasksConfig | None = None
) -> dict[str, Any]:
    """Evaluate one checkpoint of the run at `store` and write the result to eval/{name}.json."""
    from ddiloco.prepare import load_run_config, load_tokens

    ecfg = ecfg or EvalTasksConfig()
    t0 = time.monotonic()
    cfg = load_run_config(store)
    layout = read_layout(store)
    tokenizer = load_tokenizer(store)
    val = load_tokens(store, keys.VAL, cfg.run_id)
    model, info = load_model(store, spec, cfg.run_id, layout)
    model.to(resolve_device(ecfg.device))
    tasks = build_tasks(store, cfg, tokenizer, val, ecfg)
    result = {
        "run_id": cfg.run_id,
        **info,
        **evaluate_model(model, cfg=cfg, val=val, tokenizer=tokenizer, tasks=tasks),
        "seed": cfg.seed if ecfg.seed is None else ecfg.seed,
        "seconds": time.monotonic() - t0,
    }
    name = name or spec.replace(":", "-").replace("/", "_")
    store.put_json(eval_key(name), result)
    log.info(
        "evaluated %s: val loss %.4f, %s (%.1fs)",
        spec,
        result["val_loss"],
        ", ".join(f"{k} {v:.2f}" for k, v in result["task_accuracy"].items()),
        result["seconds"],
    )
    return result


# --- the global model over time (reports) --------------------------------------------------------------------
def curve_points(records: list[dict[str, Any]], num_fragments: int, points: int) -> list[dict[str, Any]]:
    """Snapshots evenly spaced in merged rounds: the versions, merge time and tokens merged by then.

    The first point is global version 0 of every fragment (before any merge); tokens merged are summed over
    the merged answers' c_tokens and divided by the number of fragments, as in the summary's ledger.
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
    if len(cumulative) <= points:
        return cumulative
    picks = sorted({round(i * (len(cumulative) - 1) / (points - 1)) for i in range(points)})
    return [cumulative[i] for i in picks]


def global_loss_curve(
    store: Store, points: int = 8, *, records: list[dict[str, Any]] | None = None, refresh: bool = False
) -> list[dict[str, Any]]:
    """Validation loss of the global model at `points` moments of the run; cached at eval/curve.json and
    recomputed when more rounds have merged since (a report of a running run) or with refresh."""
    from ddiloco.prepare import load_run_config, load_tokens

    if records is None:
        records = [store.get_json(k) for k in store.list("syncer/rounds/")]
    cached = None if refresh else store.get_json_or_none(EVAL_CURVE, max_bytes=16 << 20)
    if (
        cached is not None
        and cached.get("points_requested") == points
        and cached.get("rounds") == len(records)
    ):
        return cached["points"]
    cfg = load_run_config(store)
    layout = read_layout(store)
    val = load_tokens(store, keys.VAL, cfg.run_id)
    snaps = curve_points(records, layout.num_fragments, max(points, 2))
    for snap in snaps:
        model = model_at_versions(store, cfg.run_id, layout, snap["versions"])
        snap["val_loss"] = validation_loss(
            model,
            val,
            batch_size=cfg.train.batch_size,
            seq_len=cfg.model.seq_len,
            max_batches=cfg.eval.val_batches,
        )
    store.put_json(EVAL_CURVE, {"points_requested": points, "rounds": len(records), "points": snaps})
    return snaps
