"""Tokenizers: lossless round trips, JSON round trips, local BPE training, robust decode."""

import json

import pytest

from ddiloco.data.tokenizer import (
    BPETokenizer,
    ByteTokenizer,
    build_tokenizer,
    tokenizer_from_json,
    train_bpe,
)

TEXTS = [
    "the color of zorvak is teal. zorvak's pet is owl.",
    "17+25=42\n9*7=63",
    "copy: kqzt -> kqzt. reverse: abc -> cba.",
    "unicode: héllo wörld — ✓ 日本",
] * 20


def test_byte_roundtrip_and_specials():
    tok = ByteTokenizer()
    assert (tok.vocab_size, tok.eos_id, tok.pad_id) == (258, 256, 257)
    for text in TEXTS[:4] + ["", "<eos> literal"]:
        ids = tok.encode(text)
        assert all(0 <= i < 256 for i in ids)
        assert tok.decode(ids) == text
    assert tok.decode([104, 105, tok.eos_id, tok.pad_id, 999, -1]) == "hi"


def test_decode_never_raises_on_bad_bytes():
    tok = ByteTokenizer()
    assert tok.decode([ord("a"), 0xE2, 0x9C]).startswith("a\ufffd")  # truncated 3-byte sequence
    bpe = train_bpe(TEXTS, 300)
    ids = bpe.encode("✓")
    assert isinstance(bpe.decode(ids[:-1]), str)
    assert bpe.decode([bpe.vocab_size + 5, -3]) == ""


def test_bpe_trains_locally_and_round_trips():
    bpe = train_bpe(TEXTS, 320)
    assert isinstance(bpe, BPETokenizer)
    assert 258 <= bpe.vocab_size <= 320
    assert bpe.eos_id != bpe.pad_id and max(bpe.eos_id, bpe.pad_id) < bpe.vocab_size
    for text in TEXTS[:4] + ["never seen: Ωμέγα 🙂"]:
        ids = bpe.encode(text)
        assert bpe.decode(ids) == text
    assert len(bpe.encode(TEXTS[0])) < len(TEXTS[0].encode())  # merges were learned
    assert bpe.encode_batch(TEXTS[:2]) == [bpe.encode(t) for t in TEXTS[:2]]


def test_text_cannot_forge_eos():
    bpe = train_bpe(TEXTS, 300)
    ids = bpe.encode("a<eos>b<pad>")
    assert bpe.eos_id not in ids and bpe.pad_id not in ids
    assert bpe.decode(ids) == "a<eos>b<pad>"
    again = tokenizer_from_json(bpe.to_json())
    assert again.encode("a<eos>b") == bpe.encode("a<eos>b")


def test_json_round_trip():
    for tok in (ByteTokenizer(), train_bpe(TEXTS, 300)):
        again = tokenizer_from_json(tok.to_json())
        assert type(again) is type(tok)
        assert (again.vocab_size, again.eos_id, again.pad_id) == (tok.vocab_size, tok.eos_id, tok.pad_id)
        for text in TEXTS[:4]:
            assert again.encode(text) == tok.encode(text)
        json.loads(tok.to_json())  # plain JSON


def test_bad_json():
    with pytest.raises(ValueError, match="malformed"):
        tokenizer_from_json("{not json")
    with pytest.raises(ValueError, match='"type"'):
        tokenizer_from_json("[1, 2]")
    with pytest.raises(ValueError, match="unknown tokenizer type"):
        tokenizer_from_json('{"type": "wordpiece"}')
    with pytest.raises(ValueError, match="lacks"):
        tokenizer_from_json('{"type": "bpe"}')
    with pytest.raises(ValueError, match="malformed"):
        tokenizer_from_json('{"type": "bpe", "tokenizer": {"model": 3}}')


def test_build_tokenizer():
    assert isinstance(build_tokenizer("byte", None, None), ByteTokenizer)
    assert isinstance(build_tokenizer("bpe", TEXTS, 300), BPETokenizer)
    with pytest.raises(ValueError, match="needs texts"):
        build_tokenizer("bpe", None, 300)
    with pytest.raises(ValueError, match="at least 258"):
        build_tokenizer("bpe", TEXTS, 100)
    with pytest.raises(ValueError, match="unknown tokenizer kind"):
        build_tokenizer("sentencepiece", TEXTS, 300)
