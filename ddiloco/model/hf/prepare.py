"""The model `prepare` writes as global version 0 when `model.hf` names a Hugging Face directory.

Design choices:
- Everything that can be refused is refused here, before anything is written to the run root: an
  unusable directory or config (`ddiloco.model.hf.source`), a tokenizer vocabulary larger than the model's
  embedding table, a `model.seq_len` beyond the model's positions, and a model too large for the learner's
  device memory (estimated from the config on the meta device before any allocation).
- The architecture goes into the layout (`HFSpec`), the weights (loaded or a seeded init) into version 0.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from ddiloco.errors import ConfigError
from ddiloco.model.hf.model import HFCausalLM, HFSpec, init_hf, load_pretrained, transformers_config
from ddiloco.model.hf.source import model_dir, read_config, weight_files

log = logging.getLogger(__name__)

BYTES_PER_PARAM = 4 * 5
"""A learner's resident bytes per parameter: fp32 weights, gradients, AdamW's two moments, and the anchor
the outer gradient is taken against (activations come on top)."""


def hf_model_for_run(cfg: Any, vocab_size: int) -> HFCausalLM:
    """The model a run on `model.hf` starts from, checked against the run's tokenizer and memory."""
    path = model_dir(cfg.model.hf)
    raw = read_config(path)
    hf_cfg = transformers_config(raw)
    model_vocab = int(hf_cfg.vocab_size)
    if vocab_size > model_vocab:
        raise ConfigError(
            f"model.hf: the tokenizer has {vocab_size} ids but {path}/config.json has vocab_size "
            f"{model_vocab}; use the model's own tokenizer or raise vocab_size in config.json"
        )
    positions = getattr(hf_cfg, "max_position_embeddings", None)
    if positions is not None and cfg.model.seq_len > positions:
        raise ConfigError(
            f"model.seq_len={cfg.model.seq_len} exceeds the model's max_position_embeddings ({positions}); "
            "lower model.seq_len"
        )
    spec = HFSpec(hf_config=hf_cfg.to_dict(), block_size=cfg.model.seq_len, vocab_size=model_vocab)
    check_memory(spec, cfg)
    files = weight_files(path)
    model = load_pretrained(spec, path) if files else init_hf(spec, cfg.seed)
    origin = f"weights from {len(files)} file(s)" if files else f"seeded init (seed {cfg.seed})"
    log.info("model.hf %s: %s, %d parameters, %s", path, spec.model_type, model.num_params(), origin)
    return model


def check_memory(spec: HFSpec, cfg: Any) -> None:
    """Refuse a model whose training state cannot fit the learner's device, before allocating it."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(transformers_config(spec.hf_config))
    params = sum(p.numel() for p in meta.parameters())
    need = params * BYTES_PER_PARAM
    have, where = device_memory(cfg.train.device)
    if have is not None and need > have:
        raise ConfigError(
            f"model.hf: {spec.model_type} has {params / 1e9:.2f}B parameters, ~{need / 2**30:.1f} GiB of "
            f"training state per learner, more than the {have / 2**30:.1f} GiB of {where}; use a smaller "
            "model, or a learner with more memory"
        )


def device_memory(device: str) -> tuple[int | None, str]:
    """(bytes a learner on `device` may use, what that is), None when this machine cannot tell: learners
    on `auto` or `cuda` measured from a machine without CUDA (a CPU prepare pod of a GPU run)."""
    if device.startswith("cuda") or device == "auto":
        if torch.cuda.is_available():
            return int(torch.cuda.mem_get_info()[1]), "GPU memory"
        if device == "auto" and not os.environ.get("KUBERNETES_SERVICE_HOST"):
            return _host_memory(), "host memory"  # a laptop run: learners on this machine's CPU
        return None, "GPU memory"
    return _host_memory(), "host memory"


def _host_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return None
