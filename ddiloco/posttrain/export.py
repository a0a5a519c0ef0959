"""`ddiloco export`: a run's model as a Hugging Face directory that transformers loads with nothing else.

Design choices:
- The model is read the way `evaluate` reads it (`ddiloco.posttrain.evaluate.load_model`: final, sft,
  latest, round:N), so a signed run's model is verified before anything is written.
- A `model.hf` run exports its transformers model as it is (`save_pretrained`). The built-in GPT maps onto
  transformers' GPT-2 exactly: same blocks (pre-LayerNorm, fused QKV, exact GELU MLP, LayerNorm eps 1e-5,
  learned positions, untied head); GPT-2's Conv1D stores a Linear's weight transposed, and the biases the
  GPT does not have are zeros. Logits agree to fp32 rounding (a test holds them within 1e-5).
- The run's tokenizer goes with it as `tokenizer.json` (+ config): a model's own tokenizer as it came, with
  its eos/pad/bos tokens and chat template; the BPE flavour is already a `tokenizers` tokenizer; the byte tokenizer becomes a byte-level BPE with no merges whose ids are the byte values, with
  `<eos>` = 256 and `<pad>` = 257, so `AutoTokenizer` encodes text to the ids the run trained on.
- `--out` is a local directory or a store URL (`file://`, `s3://`): the directory is written locally first,
  then each file is put under the prefix.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ddiloco.data.tokenizer import EOS, PAD, BPETokenizer, ByteTokenizer, ModelTokenizer, Tokenizer
from ddiloco.model.gpt import GPT
from ddiloco.model.hf.model import HFCausalLM
from ddiloco.run.root import RunRoot

log = logging.getLogger(__name__)


def export_model(root: RunRoot, spec: str, out: str) -> dict[str, Any]:
    """Write the run's model `spec` (final, sft, latest, round:N) to `out` as a Hugging Face directory."""
    from ddiloco.posttrain.evaluate import load_model

    model, desc = load_model(root, spec, root.layout())
    lm = transformers_model(model)
    tok = root.tokenizer()
    if "://" in out and not out.startswith("file://"):
        with tempfile.TemporaryDirectory(prefix="ddiloco-export-") as tmp:
            files = write_dir(lm, tok, Path(tmp))
            _upload(Path(tmp), files, out)
    else:
        target = Path(out.removeprefix("file://")).expanduser()
        files = write_dir(lm, tok, target)
    log.info("exported %s of %s to %s (%s)", spec, root.url, out, ", ".join(files))
    params = sum(p.numel() for p in lm.parameters())
    return {**desc, "out": out, "files": files, "architecture": type(lm).__name__, "parameters": params}


def write_dir(lm: nn.Module, tok: Tokenizer, path: Path) -> list[str]:
    from transformers import GenerationConfig

    path.mkdir(parents=True, exist_ok=True)
    lm.config.eos_token_id, lm.config.pad_token_id = tok.eos_id, tok.pad_id
    lm.save_pretrained(path)
    GenerationConfig(eos_token_id=tok.eos_id, pad_token_id=tok.pad_id).save_pretrained(path)
    hf_tokenizer(tok).save_pretrained(path)
    return sorted(p.name for p in path.iterdir() if p.is_file())


def _upload(local: Path, files: list[str], url: str) -> None:
    from ddiloco.store.url import open_store

    store = open_store(url)
    for name in files:
        store.put(name, (local / name).read_bytes())


def transformers_model(model: nn.Module) -> nn.Module:
    """The transformers model equal to `model` (a `model.hf` model as it is; the GPT as GPT-2)."""
    if isinstance(model, HFCausalLM):
        return model.lm
    if isinstance(model, GPT):
        return gpt_as_gpt2(model)
    raise ValueError(f"cannot export a {type(model).__name__}: no transformers architecture maps onto it")


@torch.no_grad()
def gpt_as_gpt2(model: GPT) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    c = model.config
    if c.dropout:
        log.info("dropout %.2f is exported as GPT-2's dropout (inactive in eval mode)", c.dropout)
    cfg = GPT2Config(
        vocab_size=c.vocab_size,
        n_positions=c.block_size,
        n_embd=c.n_embd,
        n_layer=c.n_layer,
        n_head=c.n_head,
        activation_function="gelu",
        layer_norm_epsilon=1e-5,
        resid_pdrop=c.dropout,
        embd_pdrop=c.dropout,
        attn_pdrop=c.dropout,
        tie_word_embeddings=False,
        bos_token_id=None,
    )
    hf = GPT2LMHeadModel(cfg).eval()
    src = dict(model.named_parameters())
    for name, p in hf.named_parameters():
        p.copy_(_gpt_value(name, p, src))
    return hf


def _gpt_value(name: str, p: torch.Tensor, src: dict[str, torch.Tensor]) -> torch.Tensor:
    """GPT-2 parameter `name` from the GPT's parameters (Conv1D weights transposed, missing biases zero)."""
    conv1d = name.endswith(
        ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
    )
    if name in src:
        t = src[name].detach()
        return t.t() if conv1d else t
    if name.endswith(".bias"):
        return torch.zeros_like(p)
    raise ValueError(f"GPT-2 parameter {name} has no counterpart in the GPT")


def hf_tokenizer(tok: Tokenizer) -> Any:
    """A `PreTrainedTokenizerFast` that encodes text to the same ids as `tok`."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as RawTokenizer
    from transformers import PreTrainedTokenizerFast

    if isinstance(tok, ModelTokenizer):
        return tok.transformers_tokenizer()
    if isinstance(tok, BPETokenizer):
        raw = RawTokenizer.from_str(tok._tok.to_str())
    elif isinstance(tok, ByteTokenizer):
        from transformers.convert_slow_tokenizer import bytes_to_unicode  # the map ByteLevel applies

        raw = RawTokenizer(models.BPE(vocab={c: b for b, c in bytes_to_unicode().items()}, merges=[]))
        raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        raw.decoder = decoders.ByteLevel()
        raw.add_special_tokens([AddedToken(EOS, special=True), AddedToken(PAD, special=True)])
    else:
        raise ValueError(f"cannot export a {type(tok).__name__}")
    return PreTrainedTokenizerFast(tokenizer_object=raw, eos_token=EOS, pad_token=PAD)
