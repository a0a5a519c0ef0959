"""After pre-training: evaluate the final model, fine-tune it (SFT), evaluate the result.

`posttrain(root)` is what `ddiloco run` calls once the syncer is done; it returns the fields that go into
summary.json. Each stage also leaves its own JSON in the store (eval/final.json, sft/meta.json,
eval/sft.json), so the KFP evaluate / sft components and the report read the same numbers. The `RunRoot`
carries the run key: every model read is verified and the fine-tuned model is signed.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from ddiloco.posttrain.evaluate import EvalTasksConfig, evaluate_checkpoint, global_loss_curve
from ddiloco.posttrain.sft import SFTConfig, run_sft, skip_without_instructions
from ddiloco.posttrain.tracked import track_sft
from ddiloco.run.root import RunRoot
from ddiloco.tracking.tracker import OFF, Tracker

log = logging.getLogger(__name__)

SFT_SUMMARY_KEYS = (
    "steps",
    "train_items",
    "heldout_items",
    "heldout_split",
    "train_seconds",
    "final_loss",
    "heldout_response_loss_before",
    "heldout_response_loss_after",
    "device",
)


def posttrain(
    root: RunRoot,
    *,
    eval_cfg: EvalTasksConfig | None = None,
    sft_cfg: SFTConfig | None = None,
    skip_sft: bool = False,
    tracker: Tracker = OFF,
) -> dict[str, Any]:
    """evaluate(final) -> sft -> evaluate(sft), then the global model's loss curve; returns summary fields
    (see `summary_fields`).

    None configs mean the defaults; with skip_sft only the final model is evaluated (sft_* fields are None),
    and so it is, with a warning, for a user corpus without `sft.data` (no instructions to fine-tune on).
    Every stage logs to `tracker` (`ddiloco.posttrain.tracked`).
    """
    t0 = time.monotonic()
    sft_cfg = sft_cfg or SFTConfig()
    name = "final" if sft_cfg.base == "final" else None
    pre = evaluate_checkpoint(root, sft_cfg.base, name=name, ecfg=eval_cfg, tracker=tracker)
    if not skip_sft and skip_without_instructions(root, sft_cfg) is not None:
        skip_sft = True
    if skip_sft:
        fields = summary_fields(pre, None, None)
    else:
        sft = run_sft(root, sft_cfg)
        track_sft(tracker, sft)
        post = evaluate_checkpoint(root, "sft", name="sft", ecfg=eval_cfg, tracker=tracker)
        fields = summary_fields(pre, sft, post)
    if tracker.enabled:  # the report draws the same curve from its cache (eval/curve.json)
        global_loss_curve(root, (eval_cfg or EvalTasksConfig()).curve_points, tracker=tracker)
    fields["posttrain_seconds"] = time.monotonic() - t0
    log.info("post-training of %s done in %.1fs", root.url, fields["posttrain_seconds"])
    return fields


def summary_fields(
    pre: dict[str, Any], sft: dict[str, Any] | None, post: dict[str, Any] | None
) -> dict[str, Any]:
    """The summary.json entries of a post-training pass.

    final_val_loss / final_perplexity / task_accuracy: the pre-trained model on the validation split and the
    downstream tasks; sft_*: the same for the fine-tuned model; instruction_accuracy_before / _after: the
    held-out instruction set, exact match, per kind and "all"; sft: how the fine-tuning went.
    """
    out: dict[str, Any] = {
        "final_val_loss": pre["val_loss"],
        "final_perplexity": pre["perplexity"],
        "task_accuracy": pre["task_accuracy"],
        "sft_val_loss": None,
        "sft_perplexity": None,
        "sft_task_accuracy": None,
        "instruction_accuracy_before": None,
        "instruction_accuracy_after": None,
        "sft": None,
    }
    if sft is None or post is None:
        return out
    out.update(
        sft_val_loss=post["val_loss"],
        sft_perplexity=post["perplexity"],
        sft_task_accuracy=post["task_accuracy"],
        instruction_accuracy_before=sft["instruction_accuracy_before"],
        instruction_accuracy_after=sft["instruction_accuracy_after"],
        sft={k: sft[k] for k in SFT_SUMMARY_KEYS},
    )
    return out
