"""The tokenizer of a `model.hf` directory, loaded the way users load it: `transformers.AutoTokenizer`.

Design choices:
- `AutoTokenizer.from_pretrained(DIR, local_files_only=True)` decides what the directory's files mean
  (`tokenizer.json`, a SentencePiece `tokenizer.model` converted to a fast tokenizer, `tokenizer_config.json`,
  `chat_template.jinja`); the run keeps the resulting `tokenizers` pipeline, eos/pad/bos tokens and chat
  template as a `ModelTokenizer`, so every later stage tokenizes with exactly what prepare used and never
  reads the directory again.
- A directory without a fast (Rust) tokenizer, or whose tokenizer names no eos token, is refused with what
  to change; every refusal is a `ConfigError` naming `model.hf`.
"""

from __future__ import annotations

import logging
from pathlib import Path

from ddiloco.data.tokenizer import ModelTokenizer
from ddiloco.errors import ConfigError

log = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
"""Any of these in the model directory means it brings its own tokenizer."""


def has_tokenizer(path: Path) -> bool:
    return any((path / name).is_file() for name in TOKENIZER_FILES)


def load_model_tokenizer(path: Path) -> ModelTokenizer:
    """The directory's tokenizer as a `ModelTokenizer`."""
    from transformers import AutoTokenizer

    import ddiloco.model.hf.model  # noqa: F401  (sets HF_HUB_OFFLINE before transformers is imported)

    try:
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # transformers raises many types for a directory it cannot read
        raise ConfigError(
            f"model.hf: cannot load the tokenizer in {path} ({type(e).__name__}: {e}); fix or remove its "
            "tokenizer files, or set data.tokenizer=byte|bpe to train without the model's tokenizer"
        ) from e
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None:
        raise ConfigError(
            f"model.hf: the tokenizer in {path} is a slow (Python) tokenizer without tokenizer.json; save a "
            "fast one there (AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR) with `tokenizers`)"
        )
    template = tok.chat_template
    if isinstance(template, dict):  # named templates: the default one serves instructions
        template = template.get("default")
    try:
        out = ModelTokenizer(
            backend,
            eos_token=tok.eos_token,
            pad_token=tok.pad_token,
            bos_token=tok.bos_token,
            chat_template=template if isinstance(template, str) else None,
        )
    except ValueError as e:
        raise ConfigError(f"model.hf ({path}): {e}") from e
    log.info(
        "model.hf tokenizer: %d ids, eos %r, pad %r, chat template %s",
        out.vocab_size,
        out.eos_token,
        out.pad_token,
        "yes" if out.chat_template else "no",
    )
    return out
