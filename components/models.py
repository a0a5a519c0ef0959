"""The run's final and fine-tuned models as KFP `Model` artifacts: Hugging Face directories with a model card
in the metadata.

The artifact is the exported directory (`ddiloco export` into the artifact's local path), which KFP's
launcher uploads into the pipeline root: a URI under the run root instead would be refused by the KFP 2.17
launcher. The metadata holds format, architecture, parameters, tokens trained, validation loss and the run
root; what the run has not written is left out, never guessed. A run whose SFT was skipped has an empty
`sft_model` artifact with `present: false`. Imports neither kfp nor torch (artifacts are duck-typed).

Design notes: docs/internals.md, "Models as KFP artifacts".
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
