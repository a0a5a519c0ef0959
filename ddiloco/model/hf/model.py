"""A Hugging Face causal LM as the model a learner trains.

`HFCausalLM` wraps `transformers.AutoModelForCausalLM` behind the interface the rest of the package uses for
the built-in GPT (`forward(idx, targets) -> (logits, loss)`, `embedding_names`, `num_params`,
`flops_per_token`, `generate`, `config.block_size` / `config.vocab_size`), so fragments, merges, codecs,
checkpoints, DDP, evaluation and SFT need no model-specific code. Parameter names are transformers' own under
`lm.`. The model is built from the config with SDPA attention and a seeded init, or loaded once at prepare
from a directory with weights; tied weights are one member, buffers are never merged, and embedding tables
and the output projection are merged by the plain mean. The loss is `ddiloco.model.gpt.token_loss`, so targets
mean the same thing for both model families.

Design notes: docs/internals.md, "Hugging Face causal LMs".
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ddiloco.errors import ConfigError
from ddiloco.model.gpt import GPT, token_loss

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach the Hub: models come from a directory
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

log = logging.getLogger(__name__)

KIND = "hf"


@dataclass(kw_only=True, slots=True)
class HFSpec:
    """What `Layout.model` holds for a Hugging Face model: enough to rebuild it anywhere."""

    hf_config: dict[str, Any]
    """The model's `config.json` as transformers writes it back (`PretrainedConfig.to_dict`)."""
    block_size: int
    """Training context length (`model.seq_len`)."""
    vocab_size: int
    """Rows of the embedding table (the model's own `vocab_size`)."""
    kind: str = field(default=KIND)

    @property
    def model_type(self) -> str:
        return str(self.hf_config.get("model_type"))


def is_hf(model: dict[str, Any]) -> bool:
    """Whether a layout's `model` entry describes a Hugging Face model (else the built-in GPT)."""
    return model.get("kind") == KIND


def transformers_config(hf_config: dict[str, Any]) -> Any:
    from transformers import AutoConfig

    d = dict(hf_config)
    mt = d.pop("model_type")
    for k in ("transformers_version", "architectures", "_name_or_path", "auto_map"):
        d.pop(k, None)
    return AutoConfig.for_model(mt, **d)


class HFCausalLM(nn.Module):
    def __init__(self, spec: HFSpec, lm: nn.Module) -> None:
        super().__init__()
        self.config = spec
        self.lm = lm

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        T = idx.size(1)
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        logits = self.lm(input_ids=idx, use_cache=False).logits  # (B, T, V)
        return logits, None if targets is None else token_loss(logits, targets)

    def embedding_names(self) -> frozenset[str]:
        tables, head = self._tables_and_head()
        return frozenset(tables | head)

    def _tables_and_head(self) -> tuple[set[str], set[str]]:
        """(names of the `nn.Embedding` tables, name of the output projection: the table's when tied)."""
        by_id = {id(p): n for n, p in self.named_parameters()}
        tables = {by_id[id(m.weight)] for m in self.modules() if isinstance(m, nn.Embedding)}
        out = self.lm.get_output_embeddings()
        head = {by_id[id(out.weight)]} if out is not None and id(out.weight) in by_id else set()
        return tables, head

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """6·N (N without embedding tables; an MoE counts its active experts only) + attention's 12·L·d·T."""
        c = self.lm.config
        tables, head = self._tables_and_head()
        lookups = tables - head  # a tied table is also the head, a matmul
        n = sum(p.numel() for name, p in self.named_parameters() if name not in lookups)
        experts = getattr(c, "num_local_experts", None) or getattr(c, "num_experts", None)
        active = getattr(c, "num_experts_per_tok", None)
        if experts and active:
            expert_n = sum(p.numel() for name, p in self.named_parameters() if ".experts." in name)
            n -= expert_n * (1 - active / experts)
        layers, width = c.num_hidden_layers, c.hidden_size
        return 6.0 * n + 12.0 * layers * width * (seq_len or self.config.block_size)

    generate = GPT.generate


def init_hf(spec: HFSpec, seed: int, device: torch.device | str = "cpu") -> HFCausalLM:
    """A freshly initialised model; the same (spec, seed) always gives the same weights."""
    from transformers import AutoModelForCausalLM

    hf_cfg = transformers_config(spec.hf_config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        lm = AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="sdpa", dtype=torch.float32)
    model = HFCausalLM(spec, lm).to(device)
    log.debug("initialised %s with %d parameters (seed %d)", spec.model_type, model.num_params(), seed)
    return model


def load_pretrained(spec: HFSpec, path: Path) -> HFCausalLM:
    """The model with the weights saved in `path` (continued pre-training)."""
    from transformers import AutoModelForCausalLM

    try:
        lm = AutoModelForCausalLM.from_pretrained(
            path,
            config=transformers_config(spec.hf_config),
            attn_implementation="sdpa",
            dtype=torch.float32,
            local_files_only=True,
        )
    except (OSError, ValueError, RuntimeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(
            f"model.hf: the weights in {path} do not load ({first}); fix or remove them"
        ) from None
    return HFCausalLM(spec, lm)
