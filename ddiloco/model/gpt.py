"""A small decoder-only GPT, nanoGPT style, from a CPU-sized `tiny` preset up to ~1B parameters.

Pre-LN blocks with fused scaled-dot-product attention and learned position embeddings. The token embedding
and the LM head are untied, so fragmentation can place them apart and the merge averages each plainly
(`embedding_names()`). `init_model` is deterministic given a seed and independent of the global RNG (built
on the meta device, then GPT-2 init from one seeded generator in name order). Parameter counts and FLOPs
are computed from the config (`count_params`, `flops_per_token`), so large presets are sized without
allocating them. The loss is the mean cross-entropy over targets != -100 (SFT masks prompts with -100).

Design notes: docs/internals.md, "The built-in GPT".
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100


@dataclass(kw_only=True, slots=True)
class GPTConfig:
    vocab_size: int
    """Number of token ids (the tokenizer's vocab_size, specials included)."""
    block_size: int
    """Maximum context length (size of the position embedding)."""
    n_layer: int
    """Number of transformer blocks."""
    n_head: int
    """Attention heads per block; must divide n_embd."""
    n_embd: int
    """Residual stream width."""
    dropout: float = 0.0
    """Dropout on attention weights and residual branches (0 for pre-training)."""
    bias: bool = False
    """Biases in Linear and LayerNorm layers (False: slightly faster and no worse)."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive integer, got {value!r}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"GPTConfig.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head}); "
                f"pick n_head among the divisors of n_embd"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout!r}")


PRESETS: dict[str, dict] = {
    # ~0.1M non-embedding parameters: a few hundred steps on one CPU thread in seconds.
    "tiny": dict(n_layer=2, n_head=4, n_embd=64),
    # ~10.6M non-embedding parameters (nanoGPT's shakespeare-char shape): CPU-feasible, slow.
    "small": dict(n_layer=6, n_head=6, n_embd=384),
    # GPT-2 small / medium shapes.
    "125m": dict(n_layer=12, n_head=12, n_embd=768),
    "350m": dict(n_layer=24, n_head=16, n_embd=1024),
    # GPT-3 XL width at 18 layers: ~0.9B non-embedding, ~1.0B with a 50k vocabulary.
    "1b": dict(n_layer=18, n_head=16, n_embd=2048),
}


def gpt_config(preset: str, *, vocab_size: int, block_size: int, **overrides: object) -> GPTConfig:
    """The config of a named preset; `overrides` replace preset fields, and overrides that are None are ignored."""
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; choose one of {sorted(PRESETS)}")
    fields = dict(PRESETS[preset], vocab_size=vocab_size, block_size=block_size)
    fields.update({k: v for k, v in overrides.items() if v is not None})
    unknown = set(fields) - set(GPTConfig.__dataclass_fields__)
    if unknown:
        raise ValueError(
            f"unknown GPTConfig field(s) {sorted(unknown)}; valid: {sorted(GPTConfig.__dataclass_fields__)}"
        )
    return GPTConfig(**fields)


def count_params(cfg: GPTConfig) -> int:
    """Parameters of GPT(cfg), computed without building it (equals GPT(cfg).num_params())."""
    C, b = cfg.n_embd, int(cfg.bias)
    ln = C + b * C
    attn = C * 3 * C + b * 3 * C + C * C + b * C
    mlp = C * 4 * C + b * 4 * C + 4 * C * C + b * C
    per_layer = 2 * ln + attn + mlp
    embeddings = cfg.vocab_size * C + cfg.block_size * C + cfg.vocab_size * C  # wte, wpe, lm_head
    return cfg.n_layer * per_layer + ln + embeddings


def flops_per_token(cfg: GPTConfig, seq_len: int | None = None) -> float:
    """Training FLOPs per token (forward + backward), PaLM appendix B: 6 N + 12 L C T.

    N counts the parameters that take part in matmuls: everything but the two embedding lookups (the
    untied LM head does count). The attention term uses the full context `seq_len` (default block_size).
    """
    T = cfg.block_size if seq_len is None else seq_len
    n_matmul = count_params(cfg) - cfg.vocab_size * cfg.n_embd - cfg.block_size * cfg.n_embd
    return 6.0 * n_matmul + 12.0 * cfg.n_layer * cfg.n_embd * T


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()  # batch, time, channels
        q, k, v = self.c_attn(x).split(C, dim=2)  # 3 x (B, T, C)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))  # (B, T, C)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),
                wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
                drop=nn.Dropout(cfg.dropout),
                h=nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)]),
                ln_f=nn.LayerNorm(cfg.n_embd, bias=cfg.bias),
            )
        )
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        B, T = idx.size()  # batch, time
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        pos = torch.arange(T, device=idx.device)  # (T,)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))  # (B, T, C)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))  # (B, T, V)
        return logits, None if targets is None else token_loss(logits, targets)

    def embedding_names(self) -> frozenset[str]:
        """Names (as in named_parameters) of the token embedding, position embedding and LM head."""
        return frozenset({"transformer.wte.weight", "transformer.wpe.weight", "lm_head.weight"})

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self, seq_len: int | None = None) -> float:
        return flops_per_token(self.config, seq_len)

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 0.0,
        eos_id: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Append up to max_new_tokens to idx (B, T); greedy when temperature is 0.

        With eos_id, a row that has produced eos keeps producing eos and generation stops early once every
        row has. Returns (B, T + n_generated).
        """
        done = torch.zeros(idx.size(0), dtype=torch.bool, device=idx.device)  # (B,)
        for _ in range(max_new_tokens):
            context = idx[:, -self.config.block_size :]  # (B, <=block_size)
            logits, _ = self(context)
            logits = logits[:, -1, :].float()  # (B, V)
            if temperature == 0.0:
                nxt = logits.argmax(dim=-1)  # (B,)
            else:
                probs = F.softmax(logits / temperature, dim=-1)  # (B, V)
                nxt = torch.multinomial(probs, 1, generator=generator).squeeze(1)  # (B,)
            if eos_id is not None:
                nxt = torch.where(done, torch.full_like(nxt, eos_id), nxt)
                done |= nxt == eos_id
            idx = torch.cat([idx, nxt[:, None]], dim=1)  # (B, T + 1)
            if eos_id is not None and bool(done.all()):
                break
        return idx


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy in fp32 of (B, T, V) logits against (B, T) targets already shifted by
    the loader, ignoring `IGNORE_INDEX` (every model family's loss, so targets mean the same to all)."""
    return F.cross_entropy(
        logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=IGNORE_INDEX
    )


@torch.no_grad()
def init_model(cfg: GPTConfig, seed: int, device: torch.device | str = "cpu") -> GPT:
    """A freshly initialised GPT; the same (cfg, seed) always gives the same weights."""
    with torch.device("meta"):
        model = GPT(cfg)
    model = model.to_empty(device=device)
    gen = torch.Generator(device=model.lm_head.weight.device).manual_seed(seed)
    residual_std = 0.02 / math.sqrt(2 * cfg.n_layer)
    for name, p in sorted(model.named_parameters()):
        if ".ln_" in name:  # LayerNorm gains and biases
            p.fill_(1.0 if name.endswith("weight") else 0.0)
        elif name.endswith("bias"):
            p.zero_()
        else:
            std = residual_std if name.endswith("c_proj.weight") else 0.02
            nn.init.normal_(p, mean=0.0, std=std, generator=gen)
    logger.debug("initialised GPT with %d parameters (seed %d)", model.num_params(), seed)
    return model


def configure_optimizer(
    model: nn.Module,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float] = (0.9, 0.95),
    fused: bool | None = None,
) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices and embeddings (>= 2-D) only, not on gains and biases."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    if fused is None:
        fused = bool(params) and all(p.is_cuda for p in params)
    return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=fused)
