"""Recipes (named starting configs) and `load_config`: recipe → YAML file → `--set` overrides → validate.

Design choices:
- torchtitan style: a recipe is a function returning a fresh `RunConfig`; a derived recipe calls its base and
  mutates it, so a recipe states only what differs.
- One order of precedence everywhere (`ddiloco run`, `prepare`, `baseline --prepare`, the pipelines): the
  recipe, then the YAML file (which may name its own recipe when none is given), then each `--set` in turn.
- YAML is only an input format; the validated config travels as JSON (`config.json` at the run root).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import yaml

from ddiloco.config.overrides import apply_dict, apply_override
from ddiloco.config.run import RunConfig
from ddiloco.errors import ConfigError


def tiny_cpu() -> RunConfig:
    """Default: 4 learners, K=1, a tiny GPT on the synthetic corpus; finishes in minutes on 2 cores."""
    return RunConfig()


def sync_diloco() -> RunConfig:
    """Synchronous DiLoCo: every round waits for all M learners (K=M), one fragment (P=1), large H."""
    cfg = tiny_cpu()
    cfg.diloco.quorum = cfg.diloco.learners
    cfg.diloco.fragments = 1
    cfg.diloco.overlap = 1
    cfg.diloco.sync_every = 50
    cfg.diloco.grace = None
    return cfg


def small_gpu() -> RunConfig:
    """One GPU per learner, the 125M preset, BPE tokenizer, int4 uploads."""
    cfg = tiny_cpu()
    cfg.model.preset, cfg.model.seq_len = "125m", 1024
    cfg.data.tokenizer, cfg.data.vocab_size = "bpe", 8192
    cfg.train.batch_size, cfg.train.lr, cfg.train.warmup_steps = 32, 6e-4, 200
    cfg.train.device = "cuda"
    cfg.diloco.fragments, cfg.diloco.sync_every, cfg.diloco.codec = 12, 100, "int4"
    cfg.diloco.token_budget = 2_000_000_000
    return cfg


def paper_like() -> RunConfig:
    """The paper's settings: P = H = 24, τ = 2, M = 8, K = 1 with grace, RDA, int4, bf16 globals."""
    cfg = small_gpu()
    cfg.model.preset = "350m"
    cfg.diloco.learners, cfg.diloco.fragments, cfg.diloco.sync_every = 8, 24, 24
    cfg.diloco.global_dtype = "bf16"
    cfg.diloco.token_budget = 20_000_000_000
    return cfg


RECIPES: dict[str, Callable[[], RunConfig]] = {
    "tiny-cpu": tiny_cpu,
    "sync-diloco": sync_diloco,
    "small-gpu": small_gpu,
    "paper-like": paper_like,
}


def load_config(
    recipe: str | None = None, config_file: str | Path | None = None, overrides: Sequence[str] = ()
) -> RunConfig:
    """Build a validated config from a recipe name, an optional YAML file and `a.b=c` overrides."""
    cfg = from_recipe(recipe or "tiny-cpu")
    if config_file is not None:
        path = Path(config_file)
        doc = read_config_file(path)
        if "recipe" in doc:
            base = doc.pop("recipe")
            if recipe is None:  # an explicit --recipe wins over the file's
                cfg = from_recipe(base, where=f"{path}: ")
        apply_dict(cfg, doc)
    for item in overrides:
        apply_override(cfg, item)
    return cfg.validate()


def from_recipe(name: str, where: str = "") -> RunConfig:
    """A fresh config from the recipe called `name` (`where` prefixes the error: the file that named it)."""
    if name not in RECIPES:
        raise ConfigError(f"{where}unknown recipe {name!r}; choose one of {', '.join(RECIPES)}")
    return RECIPES[name]()


def read_config_file(path: Path) -> dict[str, Any]:
    """The YAML mapping of sections in `path` (empty file: no sections)."""
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} not found; pass an existing YAML file to --config")
    try:
        doc = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {e}") from None
    if not isinstance(doc, dict):
        raise ConfigError(
            f"config file {str(path)!r} must be a YAML mapping of sections (model:, diloco:, ...)"
        )
    return doc
