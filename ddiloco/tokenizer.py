"""Tokenizers: raw bytes, or byte-level BPE trained locally on the corpus (never downloaded).

Design choices:
- Both are byte-level, so every string encodes losslessly and decode(encode(s)) == s. decode never raises:
  ids out of range and special ids are dropped, and bytes that are not valid UTF-8 become U+FFFD.
- Two special ids, `<eos>` (document separator) and `<pad>`. Special tokens are never produced from text:
  a document that literally contains "<eos>" encodes it as ordinary bytes, so corpus text cannot forge
  document boundaries.
- A tokenizer travels as JSON (`to_json` / `tokenizer_from_json`, dispatching on "type"), stored next to the
  data shards; the BPE flavour embeds the `tokenizers` library's own JSON.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Sequence

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


class BPETokenizer(Tokenizer):
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

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        valid = [int(i) for i in ids if 0 <= int(i) < self.vocab_size]
        return self._tok.decode(valid, skip_special_tokens=True)

    def to_json(self) -> str:
        return json.dumps({"type": "bpe", "tokenizer": json.loads(self._tok.to_str())})

    def __repr__(self) -> str:
        return f"BPETokenizer(vocab_size={self.vocab_size})"


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
        raise ValueError('tokenizer JSON must be an object with a "type" field ("byte" or "bpe")')
    kind = obj["type"]
    if kind == "byte":
        return ByteTokenizer()
    if kind == "bpe":
        from tokenizers import Tokenizer as HFTokenizer

        if not isinstance(obj.get("tokenizer"), dict):
            raise ValueError('BPE tokenizer JSON lacks its "tokenizer" object')
        try:
            tok = HFTokenizer.from_str(json.dumps(obj["tokenizer"]))
        except Exception as e:  # the Rust side raises plain Exception
            raise ValueError(f"BPE tokenizer JSON is malformed ({e})") from e
        return BPETokenizer(tok)
    raise ValueError(f'unknown tokenizer type {kind!r}; expected "byte" or "bpe"')


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
