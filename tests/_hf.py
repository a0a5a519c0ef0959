"""Tiny Hugging Face model directories built in the test (no download): one per architecture family."""

from __future__ import annotations

from pathlib import Path

COMMON = {
    "vocab_size": 272,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 64,
}
ARCHS = {
    "llama": {},
    "qwen2": {},
    "qwen3": {},
    "gemma4_text": {"hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": 272},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
}
"""model_type -> what its tiny config adds (Llama, Qwen2/3, the newest Gemma text model, two MoE models)."""


def tiny_hf_dir(
    path: Path, model_type: str = "llama", *, weights: bool = False, seed: int = 0, **extra
) -> Path:
    """Write a tiny model's config.json (and its seeded weights with `weights`) into `path`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(model_type, **{**COMMON, **ARCHS[model_type], **extra})
    path.mkdir(parents=True, exist_ok=True)
    if weights:
        torch.manual_seed(seed)
        AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    else:
        cfg.save_pretrained(path)
    return path
