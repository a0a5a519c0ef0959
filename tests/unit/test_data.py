"""Corpus loading, tokenisation, shards and the resumable loader."""

import json
from pathlib import Path

import pytest
import torch

from ddiloco.data.loader import ShardLoader, load_texts, split_tokens, tokenize_corpus, val_batches
from ddiloco.data.tokenizer import ByteTokenizer, train_bpe

torch.set_num_threads(1)


def write(path: Path, content: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    return path


# --- load_texts -------------------------------------------------------------------------------------------


def test_load_single_files(tmp_path):
    assert load_texts(str(write(tmp_path / "a.txt", "hello\nworld"))) == ["hello\nworld"]
    assert load_texts(str(write(tmp_path / "b.md", "# title"))) == ["# title"]
    rows = [{"text": "one", "id": 1}, {"text": "two"}, {"text": ""}]
    jsonl = write(tmp_path / "c.jsonl", "\n".join(json.dumps(r) for r in rows) + "\n\n")
    assert load_texts(str(jsonl)) == ["one", "two"]  # empty documents and blank lines dropped
    other = write(tmp_path / "d.jsonl", json.dumps({"body": "three"}))
    assert load_texts(str(other), jsonl_field="body") == ["three"]


def test_load_directory_recursive_sorted(tmp_path):
    write(tmp_path / "b" / "z.txt", "bz")
    write(tmp_path / "a.md", "a")
    write(tmp_path / "b" / "a.jsonl", json.dumps({"text": "ba"}))
    write(tmp_path / "c.csv", "ignored")
    write(tmp_path / ".hidden" / "x.txt", "ignored")
    write(tmp_path / ".h.txt", "ignored")
    assert load_texts(str(tmp_path)) == ["a", "ba", "bz"]


@pytest.mark.parametrize(
    ("files", "source", "match"),
    [
        ({}, "missing.txt", "does not exist"),
        ({"x.csv": "a,b"}, "x.csv", "unsupported extension"),
        ({"x.csv": "a,b"}, ".", "holds no"),
        ({"x.txt": "  \n"}, "x.txt", "contains no text"),
        ({"x.txt": b"ok \xff\xfe"}, "x.txt", r"x\.txt: not UTF-8 text \(bad byte at offset 3\)"),
        ({"x.jsonl": '{"text": "a"}\n{"text": '}, "x.jsonl", r"x\.jsonl:2: invalid JSON"),
        ({"x.jsonl": '["a"]'}, "x.jsonl", r"x\.jsonl:1: expected a JSON object"),
        (
            {"x.jsonl": '{"text": "a"}\n\n{"body": "b"}'},
            "x.jsonl",
            r"x\.jsonl:3: no field 'text' \(fields: \['body'\]\)",
        ),
        ({"x.jsonl": '{"text": 3}'}, "x.jsonl", "must be a string"),
    ],
)
def test_load_errors(tmp_path, files, source, match):
    for name, content in files.items():
        write(tmp_path / name, content)
    with pytest.raises((ValueError, FileNotFoundError), match=match) as info:
        load_texts(str(tmp_path / source))
    assert "\n" not in str(info.value)


def test_load_unreadable(tmp_path, monkeypatch):
    path = write(tmp_path / "x.txt", "secret")

    def denied(self):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "read_bytes", denied)
    with pytest.raises(ValueError, match=r"x\.txt: cannot read \(Permission denied\)"):
        load_texts(str(path))


# --- tokenize_corpus / split_tokens -----------------------------------------------------------------------


def test_tokenize_corpus_separates_documents():
    tok = ByteTokenizer()
    tokens = tokenize_corpus(["ab", "é"], tok)
    assert tokens.dtype == torch.int32
    assert tokens.tolist() == [97, 98, 256, 0xC3, 0xA9, 256]
    bpe = train_bpe(["ab ab ab", "cd cd"] * 5, 280)
    tokens = tokenize_corpus(["ab ab", "cd"], bpe)
    assert tokens.tolist() == bpe.encode("ab ab") + [bpe.eos_id] + bpe.encode("cd") + [bpe.eos_id]
    assert tokenize_corpus([], tok).numel() == 0


def test_split_disjoint_and_covering():
    tokens = torch.arange(1003, dtype=torch.int32)
    shards, val = split_tokens(tokens, num_shards=4, val_fraction=0.1)
    assert len(shards) == 4 and val.numel() == 100
    assert torch.equal(torch.cat([*shards, val]), tokens)  # contiguous, disjoint, covering; val at the end
    assert max(s.numel() for s in shards) - min(s.numel() for s in shards) <= 1
    tokens[0] = -1
    assert shards[0][0] == 0  # shards own their memory


def test_split_errors():
    tokens = torch.arange(100, dtype=torch.int32)
    with pytest.raises(ValueError, match="fewer than the 65 needed"):
        split_tokens(tokens, num_shards=2, val_fraction=0.1, min_shard_tokens=65)
    with pytest.raises(ValueError, match="no validation data"):
        split_tokens(tokens, num_shards=1, val_fraction=0.001)
    with pytest.raises(ValueError, match="val_fraction"):
        split_tokens(tokens, num_shards=1, val_fraction=1.0)
    with pytest.raises(ValueError, match="num_shards"):
        split_tokens(tokens, num_shards=0, val_fraction=0.1)
    shards, val = split_tokens(tokens, num_shards=1, val_fraction=0.0)
    assert val.numel() == 0 and torch.equal(shards[0], tokens)


# --- ShardLoader ------------------------------------------------------------------------------------------


def test_loader_batches_are_shifted_windows():
    tokens = torch.arange(500, dtype=torch.int32)
    loader = ShardLoader(tokens, batch_size=4, seq_len=16, seed=0)
    assert loader.tokens_per_batch == 64
    x, y = loader.next_batch()
    assert x.shape == y.shape == (4, 16) and x.dtype == y.dtype == torch.long
    assert torch.equal(y, x + 1)  # tokens are positions, so the targets are the next position
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_loader_epoch_visits_each_window_once():
    tokens = torch.arange(16 * 40 + 1, dtype=torch.int32)
    loader = ShardLoader(tokens, batch_size=1, seq_len=16, seed=1)
    offsets = set()
    for epoch in range(4):
        starts = []
        while loader.state_dict()["epoch"] == epoch:
            starts.append(int(loader.next_batch()[0][0, 0]))
        offset = starts[0] % 16  # each epoch shifts the grid of window starts
        assert sorted(starts) == list(range(offset, 640 - 16 + 1, 16))
        offsets.add(offset)
    assert len(offsets) > 1


def test_loader_deterministic_and_seeded():
    tokens = torch.randint(0, 258, (3000,), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    a = ShardLoader(tokens, batch_size=4, seq_len=32, seed=5)
    b = ShardLoader(tokens, batch_size=4, seq_len=32, seed=5)
    c = ShardLoader(tokens, batch_size=4, seq_len=32, seed=6)
    for _ in range(40):  # spans several epochs (23 windows each)
        xa, ya = a.next_batch()
        xb, yb = b.next_batch()
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert not torch.equal(a.next_batch()[0], c.next_batch()[0])


def test_loader_resume_matches_uninterrupted():
    tokens = torch.randint(0, 258, (2000,), dtype=torch.int32, generator=torch.Generator().manual_seed(1))
    reference = ShardLoader(tokens, batch_size=3, seq_len=32, seed=9)
    expected = [reference.next_batch() for _ in range(60)]
    for stop in (0, 7, 20, 41):  # 20 and 41 land next to epoch boundaries (20 windows of 3 per batch)
        first = ShardLoader(tokens, batch_size=3, seq_len=32, seed=9)
        for _ in range(stop):
            first.next_batch()
        state = json.loads(json.dumps(first.state_dict()))
        resumed = ShardLoader(tokens, batch_size=3, seq_len=32, seed=0)  # the cursor carries the seed
        resumed.load_state_dict(state)
        for x, y in expected[stop:]:
            rx, ry = resumed.next_batch()
            assert torch.equal(rx, x) and torch.equal(ry, y)


def test_loader_errors():
    tokens = torch.arange(64, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"fewer than one batch needs \(4 x 16 \+ 1 = 65\)"):
        ShardLoader(tokens, batch_size=4, seq_len=16, seed=0)
    loader = ShardLoader(torch.arange(65, dtype=torch.int32), batch_size=4, seq_len=16, seed=0)
    assert torch.equal(loader.next_batch()[0][:, 0].sort().values, torch.tensor([0, 16, 32, 48]))
    state = loader.state_dict()
    with pytest.raises(ValueError, match="num_tokens=65 but this loader has num_tokens=100"):
        ShardLoader(torch.arange(100, dtype=torch.int32), batch_size=4, seq_len=16, seed=0).load_state_dict(
            state
        )


# --- val_batches ------------------------------------------------------------------------------------------


def test_val_batches_fixed_non_overlapping():
    tokens = torch.arange(16 * 10 + 5, dtype=torch.int32)
    batches = val_batches(tokens, batch_size=4, seq_len=16)
    assert [x.shape[0] for x, _ in batches] == [4, 4, 2]
    starts = torch.cat([x[:, 0] for x, _ in batches])
    assert starts.tolist() == list(range(0, 160, 16))
    assert all(torch.equal(y, x + 1) for x, y in batches)
    again = val_batches(tokens, batch_size=4, seq_len=16)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(batches, again, strict=True))
    assert len(val_batches(tokens, batch_size=4, seq_len=16, max_batches=2)) == 2
    with pytest.raises(ValueError, match="fewer than one sequence"):
        val_batches(tokens[:16], batch_size=4, seq_len=16)
