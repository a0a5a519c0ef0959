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

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
GEMMA_CHAT = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else "
    "m['role'] }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
TOKENIZERS = {  # family -> (special tokens, eos, pad, bos, chat template), shaped like the real ones
    "llama": (["<s>", "</s>"], "</s>", None, "<s>", None),
    "qwen": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "<|endoftext|>", "<|endoftext|>", None, CHATML),
    "gemma": (
        ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"], "<eos>", "<pad>", "<bos>", GEMMA_CHAT
    ),
}  # fmt: skip
FAMILY = {"llama": "llama", "mixtral": "llama", "qwen2": "qwen", "qwen3": "qwen", "qwen3_moe": "qwen"}
SAMPLE = "the quick brown fox jumps over the lazy dog; def f(x): return x ** 2. " * 8


def tiny_tokenizer(path: Path, family: str, vocab_size: int = 272) -> Path:
    """A byte-level BPE trained on a sample sentence, saved the way transformers saves a model's tokenizer,
    with the family's special tokens, eos/pad/bos and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials, eos, pad, bos, template = TOKENIZERS[family]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )  # fmt: skip
    tok.train_from_iterator([SAMPLE] * 4, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=eos, pad_token=pad, bos_token=bos, chat_template=template
    )
    path.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(path)
    return path


def tiny_hf_dir(
    path: Path,
    model_type: str = "llama",
    *,
    weights: bool = False,
    tokenizer: bool = False,
    seed: int = 0,
    **extra,
) -> Path:
    """Write a tiny model's config.json (its seeded weights with `weights`, its family's tokenizer with
    `tokenizer`) into `path`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(model_type, **{**COMMON, **ARCHS[model_type], **extra})
    path.mkdir(parents=True, exist_ok=True)
    if weights:
        torch.manual_seed(seed)
        AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    else:
        cfg.save_pretrained(path)
    if tokenizer:
        tiny_tokenizer(path, FAMILY.get(model_type, model_type.split("_")[0].rstrip("0123456789")))
    return path
