"""What post-training logs for experiment tracking (`ddiloco.tracking`): the TensorBoard run `tb/posttrain/`
and the run's MLflow run. Steps are the run's tokens merged (the syncer's x axis), except SFT's own steps.

- `global/val_loss`: the global model's validation loss at each moment of the loss curve (the published
  versions the run keeps, `ddiloco.posttrain.evaluate.global_loss_curve`), logged when the curve is computed.
- `eval/{name}/val_loss`, `eval/{name}/perplexity`, `eval/{name}/accuracy/{task}` of each evaluated model.
- `sft/loss` per fine-tuning step (as sampled by `run_sft`), `sft/instruction_accuracy_{before,after}`,
  `sft/heldout_response_loss_{before,after}`.
- The final and fine-tuned models (`final/`, `sft/` in the store) as MLflow artifacts.
"""

from __future__ import annotations

from typing import Any

from ddiloco import keys
from ddiloco.config.run import RunConfig
from ddiloco.run.root import RunRoot
from ddiloco.store.base import Store
from ddiloco.tracking.tracker import Tracker, open_tracker

MODEL_PREFIXES = {"final": "final/", "sft": "sft/"}
CLOSE_S = 120.0
"""How long post-training waits at its end for MLflow to take what is queued (model artifacts included)."""


def posttrain_tracker(store: Store | str, cfg: RunConfig) -> Tracker:
    """The tracker of a post-training command (`ddiloco run`'s post-training, `evaluate`, `sft`, `report`):
    role `posttrain`, MLflow included."""
    return open_tracker(
        store, cfg.tracking, "posttrain", run_id=cfg.run_id, mlflow=True, close_timeout=CLOSE_S
    )


def tokens_merged(root: RunRoot) -> int:
    """The run's tokens merged by its end (the final model's), 0 when there is no final model yet."""
    meta = root.document(keys.FINAL_META) or {}
    value = meta.get("tokens_merged")
    return int(value) if isinstance(value, int | float) else 0


def track_curve(tracker: Tracker, points: list[dict[str, Any]]) -> None:
    for p in points:
        tracker.scalars({"global/val_loss": p.get("val_loss")}, p.get("tokens_merged") or 0, p.get("time"))


def track_eval(tracker: Tracker, root: RunRoot, name: str, result: dict[str, Any]) -> None:
    """An evaluation result (`evaluate_checkpoint`); the final and SFT models go up as artifacts too."""
    if not tracker.enabled:
        return
    values = {
        f"eval/{name}/val_loss": result.get("val_loss"),
        f"eval/{name}/perplexity": result.get("perplexity"),
    }
    values |= {f"eval/{name}/accuracy/{t}": a for t, a in (result.get("task_accuracy") or {}).items()}
    tracker.scalars(values, tokens_merged(root))
    if name in MODEL_PREFIXES:
        tracker.artifacts(MODEL_PREFIXES[name], f"{name}_model")


def track_sft(tracker: Tracker, metrics: dict[str, Any]) -> None:
    curve = metrics.get("loss_curve") or []
    every = max(1, int(metrics.get("steps") or 0) // 50)  # how `run_sft` samples its losses
    for i, loss in enumerate(curve):
        tracker.scalar("sft/loss", loss, i * every)
    end = {
        "sft/instruction_accuracy_before": (metrics.get("instruction_accuracy_before") or {}).get("all"),
        "sft/instruction_accuracy_after": (metrics.get("instruction_accuracy_after") or {}).get("all"),
        "sft/heldout_response_loss_before": metrics.get("heldout_response_loss_before"),
        "sft/heldout_response_loss_after": metrics.get("heldout_response_loss_after"),
    }
    tracker.scalars(end, int(metrics.get("steps") or 0))
