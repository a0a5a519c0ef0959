"""The run's final and fine-tuned models as KFP `Model` artifacts: Hugging Face directories with a model card
in the metadata.

Design choices:
- The artifact *is* the exported directory (`ddiloco export` into the artifact's local path): KFP's
  launcher uploads it to the artifact's URI in the pipeline root, so the URI the UI shows is a directory
  that `transformers.AutoModelForCausalLM.from_pretrained` loads once downloaded. The URI cannot be a
  prefix of the run root instead: the KFP 2.17 launcher takes a URI the component reports
  (launcher_v2.go mergeRuntimeArtifacts) but then uploads to it and refuses one outside the pipeline
  root's bucket and prefix (uploadOutputArtifacts -> objectstore.Config.KeyFromURI: "does not have expected
  bucket prefix"), failing the step; tests/twin/launcher.py follows that rule.
- Metadata (the UI's model card, MLMD custom properties): format, framework, checkpoint, architecture,
  parameters (of the exported model), tokens trained (the tokens the syncer merged into the final model;
  an SFT model adds its steps and examples), validation loss and perplexity of the checkpoint's evaluation
  (the export steps run after the evaluate steps), and the run root it came from. What the run has not
  written is left out, never guessed.
- A run whose SFT was skipped (a user corpus without `sft.data`) has no fine-tuned model: the `sft_model`
  artifact is empty with `present: false`, and the step succeeds.
- Imports neither kfp nor torch (artifacts are duck-typed: `.path`, `.metadata`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

from ddiloco.components.runtime import ddiloco, open_run_store

from ddiloco import keys

log = logging.getLogger(__name__)

CHECKPOINTS = {"final": keys.FINAL_META, "sft": keys.SFT_META}
"""The checkpoints a Model artifact is made for -> the JSON the run writes beside each."""


def export_model(model: Any, store_url: str, which: str, s3_endpoint: str = "") -> None:
    """Checkpoint `which` (final or sft) of the run at `store_url` as a Hugging Face directory in the Model
    artifact `model` (`ddiloco export --out model.path`), its model card in `model.metadata`."""
    if which not in CHECKPOINTS:
        raise ValueError(f"unknown checkpoint {which!r}: a Model artifact is made for final or sft")
    store = open_run_store(store_url, s3_endpoint)
    docs = {name: store.get_json_or_none(key, max_bytes=16 << 20) for name, key in CHECKPOINTS.items()}
    evaluated = store.get_json_or_none(keys.eval_key(which))
    if which == "sft" and docs["sft"] is None:
        skipped = store.get_json_or_none(keys.SFT_SKIPPED) or {}
        log.warning("no fine-tuned model in %s (%s): sft_model stays empty", store_url, skipped.get("reason"))
        model.metadata.update({"checkpoint": which, "present": False, "run_root": store_url})
        return
    printed = ddiloco("export", store=store_url, model=which, out=model.path, s3_endpoint=s3_endpoint) or {}
    model.metadata.update(model_card(which, store_url, printed, docs, evaluated))


def model_card(
    which: str,
    store_url: str,
    printed: Mapping[str, Any],
    docs: Mapping[str, Mapping[str, Any] | None],
    evaluated: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """The metadata of a Model artifact: what `ddiloco export` printed, the run's final/meta.json and
    sft/meta.json (`docs`) and the checkpoint's evaluation (eval/NAME.json); absent values left out."""
    final, sft = docs.get("final") or {}, docs.get("sft") or {}
    card: dict[str, Any] = {
        "format": "huggingface",
        "framework": "transformers",
        "checkpoint": which,
        "present": True,
        "run_root": store_url,
        "architecture": printed.get("architecture"),
        "parameters": printed.get("parameters"),
        "files": list(printed.get("files") or []),
        "tokens_trained": final.get("tokens_merged"),
    }
    if which == "sft":
        card |= {"sft_steps": sft.get("steps"), "sft_examples": sft.get("train_items")}
    for name in ("val_loss", "perplexity"):
        card[name] = (evaluated or {}).get(name)
    return {k: v for k, v in card.items() if _known(v)}


def _known(value: Any) -> bool:
    """A value worth a metadata field: not absent, and a finite number when it is one."""
    if value is None:
        return False
    return not isinstance(value, float) or math.isfinite(value)
