"""Where a Hugging Face model directory comes from, and whether it describes a model a learner can train.

Design choices:
- `model.hf` names a directory: a local path, or a `file://` / `s3://` prefix opened with the run's own
  store code (`ddiloco.store.url.open_store`: same credentials, retries and S3 settings as the run root). A
  prefix is copied once into a local cache directory keyed by its URL and the objects' sizes, so a second
  prepare on the same machine reads nothing again. Nothing is ever fetched from the Hugging Face Hub:
  `HF_HUB_OFFLINE` is set before transformers is imported (`ddiloco.model.hf.model`).
- Only what `prepare` needs is read here: `config.json` (checked to be a decoder-only causal LM that the
  pinned transformers knows) and, when present, the weights (one `model.safetensors`, or shards named by
  `model.safetensors.index.json`, every one of which must exist). Learners and the syncer never read the
  directory: the architecture travels in the layout (`Layout.model`), the weights as global version 0.
- Every refusal is a `ConfigError` naming the key `model.hf` and what to change.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

from ddiloco.errors import ConfigError

log = logging.getLogger(__name__)

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
MAX_FILE_BYTES = 64 << 30
"""Largest single object copied from a store prefix (a safetensors shard)."""
CACHE_ENV = "DDILOCO_HF_CACHE"
"""Directory for copies of `model.hf` store prefixes (default: `<tmp>/ddiloco-hf`)."""


def model_dir(spec: str) -> Path:
    """The local directory `model.hf` names (a store prefix is copied into the cache first)."""
    spec = spec.strip()
    if "://" not in spec:
        path = Path(spec).expanduser()
        if not path.is_dir():
            raise ConfigError(
                f"model.hf={spec!r} is not a directory: give a directory holding config.json "
                "(a local path, file:///abs/dir or s3://bucket/prefix)"
            )
        return path.resolve()
    if spec.startswith("file://"):
        return model_dir(spec[len("file://") :] or "/")
    if not spec.startswith("s3://"):
        raise ConfigError(f"model.hf={spec!r}: use a local directory, file:///abs/dir or s3://bucket/prefix")
    return _copy_prefix(spec)


def _copy_prefix(url: str) -> Path:
    from ddiloco.store.url import open_store

    store = open_store(url)
    sizes = store.sizes("")
    if CONFIG not in sizes:
        raise ConfigError(
            f"model.hf={url!r} holds no config.json ({len(sizes)} objects under it): name the prefix "
            "that holds the model's config.json"
        )
    fingerprint = hashlib.sha256(json.dumps([url, sorted(sizes.items())]).encode()).hexdigest()[:16]
    root = Path(os.environ.get(CACHE_ENV) or Path(tempfile.gettempdir()) / "ddiloco-hf") / fingerprint
    done = root / ".complete"
    if done.exists():
        return root
    root.mkdir(parents=True, exist_ok=True)
    for key, size in sorted(sizes.items()):
        target = root / key
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(target.name + ".part")
        tmp.write_bytes(store.get(key, max_bytes=min(size, MAX_FILE_BYTES)))
        tmp.replace(target)
    done.write_text(url)
    log.info("copied model.hf %s (%d files, %d bytes) to %s", url, len(sizes), sum(sizes.values()), root)
    return root


def read_config(path: Path) -> dict[str, Any]:
    """`config.json` of a model directory, checked to describe a decoder-only causal LM."""
    file = path / CONFIG
    if not file.is_file():
        raise ConfigError(f"model.hf: {path} has no config.json; name the directory of a Hugging Face model")
    try:
        cfg = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"model.hf: {file} is not readable JSON ({e}); fix or replace it") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"model.hf: {file} is not a JSON object")
    check_causal(cfg, str(file))
    return cfg


def check_causal(cfg: dict[str, Any], where: str) -> None:
    """Refuse what a learner cannot pre-train: an unknown `model_type`, an encoder-decoder, an encoder."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    mt = cfg.get("model_type")
    if not isinstance(mt, str) or mt not in CONFIG_MAPPING_NAMES:
        raise ConfigError(
            f"model.hf: {where} has model_type {mt!r}, which the pinned transformers does not know; "
            "use a model_type it supports (llama, qwen2, qwen3, gemma4_text, mixtral, qwen3_moe, ...)"
        )
    if cfg.get("is_encoder_decoder"):
        raise ConfigError(
            f"model.hf: {where} is an encoder-decoder model ({mt}); only decoder-only causal LMs pre-train here"
        )
    if mt not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ConfigError(
            f"model.hf: {where} is a {mt} model, which has no causal-LM head in transformers; "
            "use a decoder-only model (e.g. llama, qwen3, gemma4_text, mixtral)"
        )
    archs = cfg.get("architectures") or []
    causal = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    encoder = mt in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not cfg.get("is_decoder", False)
    if encoder or (archs and not any(a in causal for a in archs)):
        raise ConfigError(
            f"model.hf: {where} describes an encoder ({', '.join(archs) or mt}), not a causal LM; "
            "use a decoder-only model (e.g. llama, qwen3, gemma4_text, mixtral)"
        )


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a model directory ([] when it has none: a seeded random init)."""
    index = path / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            shards = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ConfigError(
                f"model.hf: {index} is not a safetensors index ({e!r}); fix or remove it"
            ) from None
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise ConfigError(
                f"model.hf: {index} names {len(missing)} missing weight shard(s) ({', '.join(missing[:3])}); "
                "copy every shard into the directory, or remove the index for a random init"
            )
        return [path / s for s in shards]
    single = path / WEIGHTS
    if single.is_file():
        return [single]
    others = sorted(path.glob("*.safetensors"))
    if others:
        raise ConfigError(
            f"model.hf: {path} has {len(others)} safetensors file(s) but neither {WEIGHTS} nor {INDEX}; "
            "save the model with save_pretrained"
        )
    return []
