"""Tokenizers: raw bytes, byte-level BPE trained locally on the corpus (never downloaded), or the tokenizer
of a `model.hf` directory.

The byte and BPE tokenizers are byte-level: every string encodes losslessly, and decode never raises. Two
special ids, `<eos>` (document separator) and `<pad>`, are never produced from text, so corpus text cannot
forge document boundaries. A tokenizer travels as JSON (`to_json` / `tokenizer_from_json`), stored next to
the data shards. A model's tokenizer (`ModelTokenizer`) is the `tokenizers` pipeline `AutoTokenizer`
builds from the model directory, with the model's eos token as the document separator and its chat
template; only a rendered chat template (`chat_prompt_ids`) contains its special tokens.

Design notes: docs/internals.md, "Tokenizers".
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Sequence
from typing import Any

logger = logging.getLogger(__name__)

EOS = "<eos>"
PAD = "<pad>"


class Tokenizer:
    """Interface: vocab_size, eos_id, pad_id, encode, decode, to_json."""

    vocab_size: int
    eos_id: int
    pad_id: int

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        raise NotImplementedError

    def to_json(self) -> str:
        raise NotImplementedError

    def chat_prompt_ids(self, prompt: str) -> list[int]:
        """The ids an instruction is given as: <eos> + prompt, or a chat template's user turn."""
        return [self.eos_id, *self.encode(prompt)]


class ByteTokenizer(Tokenizer):
    """Ids 0-255 are UTF-8 bytes; 256 is <eos>, 257 is <pad>."""

    def __init__(self) -> None:
        self.vocab_size = 258
        self.eos_id = 256
        self.pad_id = 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        data = bytes(int(i) for i in ids if 0 <= int(i) < 256)
        return data.decode("utf-8", errors="replace")

    def to_json(self) -> str:
        return json.dumps({"type": "byte"})

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=258)"


class _RustBacked(Tokenizer):
    """Encoding and decoding through a `tokenizers.Tokenizer` (`_tok`) that never produces special tokens
    from text (`encode_special_tokens`); ids out of range and special ids are dropped when decoding."""

    _tok: Any

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        valid = [int(i) for i in ids if 0 <= int(i) < self.vocab_size]
        return self._tok.decode(valid, skip_special_tokens=True)


class BPETokenizer(_RustBacked):
    """Byte-level BPE (GPT-2 style pre-tokenisation) wrapping a trained `tokenizers.Tokenizer`."""

    def __init__(self, tok: object) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        if not isinstance(tok, HFTokenizer):
            raise TypeError(f"BPETokenizer wraps a tokenizers.Tokenizer, got {type(tok).__name__}")
        eos, pad = tok.token_to_id(EOS), tok.token_to_id(PAD)
        if eos is None or pad is None:
            raise ValueError(f"BPE tokenizer lacks the special tokens {EOS!r} and {PAD!r}")
        tok.encode_special_tokens = True  # not serialised by `tokenizers`; see the module docstring
        self._tok = tok
        self.vocab_size = tok.get_vocab_size()
        self.eos_id = eos
        self.pad_id = pad

    def to_json(self) -> str:
        return json.dumps({"type": "bpe", "tokenizer": json.loads(self._tok.to_str())})

    def __repr__(self) -> str:
        return f"BPETokenizer(vocab_size={self.vocab_size})"


class ModelTokenizer(_RustBacked):
    """A model's own tokenizer (see the module docstring); vocab_size is its largest id + 1."""

    def __init__(
        self,
        tok: object,
        eos_token: str | None,
        pad_token: str | None = None,
        bos_token: str | None = None,
        chat_template: str | None = None,
    ) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        if not isinstance(tok, HFTokenizer):
            raise TypeError(f"ModelTokenizer wraps a tokenizers.Tokenizer, got {type(tok).__name__}")
        eos = tok.token_to_id(eos_token) if eos_token else None
        if eos is None:
            raise ValueError(
                f"the model's tokenizer has no eos token ({eos_token!r}); set eos_token in the model "
                "directory's tokenizer_config.json to the token that ends a document"
            )
        pad = tok.token_to_id(pad_token) if pad_token else None
        self._tok = HFTokenizer.from_str(tok.to_str())
        self._tok.encode_special_tokens = True  # text never forges a special token
        self._raw = tok  # special tokens recognised: what a chat template renders
        self.eos_token, self.pad_token, self.bos_token = eos_token, pad_token, bos_token
        self.chat_template = chat_template or None
        self.vocab_size = max(tok.get_vocab(with_added_tokens=True).values()) + 1
        self.eos_id = eos
        self.pad_id = eos if pad is None else pad
        self._chat: object | None = None

    def to_json(self) -> str:
        return json.dumps(
            {
                "type": "model",
                "tokenizer": json.loads(self._raw.to_str()),
                "eos_token": self.eos_token,
                "pad_token": self.pad_token,
                "bos_token": self.bos_token,
                "chat_template": self.chat_template,
            }
        )

    def transformers_tokenizer(self) -> object:
        """This tokenizer as a transformers `PreTrainedTokenizerFast` (chat template, export)."""
        from tokenizers import Tokenizer as HFTokenizer
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast(
            tokenizer_object=HFTokenizer.from_str(self._raw.to_str()),
            eos_token=self.eos_token,
            pad_token=self.pad_token,
            bos_token=self.bos_token,
            chat_template=self.chat_template,
        )

    def chat_prompt_ids(self, prompt: str) -> list[int]:
        if self.chat_template is None:
            return super().chat_prompt_ids(prompt)
        if self._chat is None:
            self._chat = self.transformers_tokenizer()
        ids = self._chat.apply_chat_template(  # type: ignore[attr-defined]
            [{"role": "user", "content": prompt}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        return list(ids)

    def __repr__(self) -> str:
        return f"ModelTokenizer(vocab_size={self.vocab_size}, eos={self.eos_token!r})"


def train_bpe(texts: Iterable[str], vocab_size: int) -> BPETokenizer:
    """Train byte-level BPE on texts, locally. The result may be smaller than vocab_size on a small corpus."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    min_size = 256 + 2
    if vocab_size < min_size:
        raise ValueError(
            f"BPE vocab_size must be at least {min_size} (256 bytes + {EOS} + {PAD}), got {vocab_size}"
        )
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    bpe = BPETokenizer(tok)
    logger.info("trained byte-level BPE: %d tokens (asked for %d)", bpe.vocab_size, vocab_size)
    return bpe


def tokenizer_from_json(s: str) -> Tokenizer:
    """Rebuild a tokenizer from `Tokenizer.to_json()` output."""
    try:
        obj = json.loads(s)
    except (json.JSONDecodeError, TypeError) as e:
        raise ValueError(f"tokenizer JSON is malformed ({e}); regenerate it with `ddiloco prepare`") from e
    if not isinstance(obj, dict) or "type" not in obj:
        raise ValueError('tokenizer JSON must be an object with a "type" field ("byte", "bpe" or "model")')
    kind = obj["type"]
    if kind == "byte":
        return ByteTokenizer()
    if kind == "bpe":
        return BPETokenizer(_rust_tokenizer(obj, "BPE"))
    if kind == "model":
        return _model_tokenizer_from(obj)
    raise ValueError(f'unknown tokenizer type {kind!r}; expected "byte", "bpe" or "model"')


def _rust_tokenizer(obj: dict, what: str) -> Any:
    """The `tokenizers.Tokenizer` a BPE or model tokenizer's JSON embeds."""
    from tokenizers import Tokenizer as HFTokenizer

    if not isinstance(obj.get("tokenizer"), dict):
        raise ValueError(f'{what} tokenizer JSON lacks its "tokenizer" object')
    try:
        return HFTokenizer.from_str(json.dumps(obj["tokenizer"]))
    except Exception as e:  # the Rust side raises plain Exception
        raise ValueError(f"{what} tokenizer JSON is malformed ({e})") from e


def _model_tokenizer_from(obj: dict) -> ModelTokenizer:
    tok = _rust_tokenizer(obj, "model")
    fields = {k: obj.get(k) for k in ("eos_token", "pad_token", "bos_token", "chat_template")}
    if not all(v is None or isinstance(v, str) for v in fields.values()):
        raise ValueError(
            "model tokenizer JSON: eos_token, pad_token, bos_token, chat_template must be strings"
        )
    return ModelTokenizer(tok, **fields)


def build_tokenizer(
    kind: str, texts: Iterable[str] | None = None, vocab_size: int | None = None
) -> Tokenizer:
    """A byte tokenizer, or a BPE tokenizer trained on texts with vocab_size tokens."""
    if kind == "byte":
        return ByteTokenizer()
    if kind == "bpe":
        if texts is None or vocab_size is None:
            raise ValueError("a BPE tokenizer needs texts to train on and a vocab_size")
        return train_bpe(texts, vocab_size)
    raise ValueError(f'unknown tokenizer kind {kind!r}; expected "byte" or "bpe"')
