"""`ddiloco.data.textcorpus`: text files -> content-addressed `.npy` token parts, streamed, in parallel, reused."""

import gzip
import io
import json
from pathlib import Path

import numpy as np
import pytest

from ddiloco.cli.main import main
from ddiloco.data.loader import tokenize_corpus
from ddiloco.data.textcorpus.choose import tokenizer_from_spec
from ddiloco.data.textcorpus.corpus import tokenize_to_npy
from ddiloco.data.textcorpus.npyparts import token_dtype
from ddiloco.data.tokenizer import BPETokenizer, ByteTokenizer, Tokenizer, train_bpe
from ddiloco.errors import CorpusError
from ddiloco.store.file import FileStore
from ddiloco.store.memory import MemoryStore

TEXTS = [f"document {i}: {'ünïcode ' * (i % 3)}words {i * 7} and more" for i in range(40)]


class Counting(Tokenizer):
    """A tokenizer that counts its encode_batch calls (and can crash on a marker), same JSON as `inner`."""

    def __init__(
        self, inner: Tokenizer | None = None, vocab_size: int | None = None, crash_on: str = ""
    ) -> None:
        self.inner = inner or ByteTokenizer()
        self.vocab_size = vocab_size or self.inner.vocab_size
        self.eos_id, self.pad_id = self.inner.eos_id, self.inner.pad_id
        self.calls, self.crash_on = 0, crash_on

    def encode_batch(self, texts):
        self.calls += 1
        if self.crash_on and any(self.crash_on in t for t in texts):
            raise RuntimeError("simulated crash")
        return self.inner.encode_batch(texts)

    def to_json(self) -> str:
        return (
            self.inner.to_json()
            if self.vocab_size == self.inner.vocab_size
            else json.dumps({"type": "test", "vocab": self.vocab_size})
        )


def _jsonl(path: Path, texts, field="text") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({field: t, "id": i}) + "\n" for i, t in enumerate(texts)))


def _tokens(store, result) -> np.ndarray:
    m = result.manifest
    arrays = [np.load(io.BytesIO(store.get(f"{result.prefix}/{p['key']}"))) for p in m["parts"]]
    assert all(a.dtype == np.dtype(m["dtype"]) and a.size <= m["shard_tokens"] for a in arrays)
    return np.concatenate(arrays) if arrays else np.zeros(0, np.int64)


def _expected(texts, tok) -> np.ndarray:
    return tokenize_corpus([t for t in texts if t.strip()], tok).numpy()


def _write_format(kind: str, root: Path, texts) -> None:
    if kind == "txt":
        for i, t in enumerate(texts):
            (root / f"doc{i:03d}.txt").write_text(t)
    elif kind == "jsonl":
        _jsonl(root / "a.jsonl", texts[:25])
        _jsonl(root / "sub" / "b.jsonl", texts[25:])
    elif kind == "jsonl.gz":
        with gzip.open(root / "a.jsonl.gz", "wt") as f:
            f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    elif kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(
            pa.table({"text": texts, "n": list(range(len(texts)))}), root / "a.parquet", row_group_size=7
        )
    elif kind == "datasets":
        import datasets

        datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(root / "ds"), max_shard_size="1KB")


@pytest.mark.parametrize("kind", ["txt", "jsonl", "jsonl.gz", "parquet", "datasets"])
def test_each_format_round_trips_to_the_tokens_of_tokenize_corpus(tmp_path, kind):
    (tmp_path / "in").mkdir()
    _write_format(kind, tmp_path / "in", TEXTS)
    store = MemoryStore(f"fmt-{kind}")
    tok = ByteTokenizer()
    result = tokenize_to_npy(str(tmp_path / "in"), store, "tok", tok, shard_tokens=300)
    assert len(result.manifest["parts"]) > 1
    assert np.array_equal(_tokens(store, result), _expected(TEXTS, tok))
    assert result.manifest["documents"] == len(TEXTS)


def test_a_bpe_tokenizer_and_a_store_prefix_as_input_give_the_same_tokens_as_tokenize_corpus():
    tok = train_bpe(TEXTS, 300)
    src = MemoryStore("bpe-src")
    src.put("in/a.jsonl", "".join(json.dumps({"body": t}) + "\n" for t in TEXTS).encode())
    src.put("in/.hidden.jsonl", b"not json\n")
    store = MemoryStore("bpe-out")
    result = tokenize_to_npy("memory://bpe-src/in", store, "", tok, field="body")
    assert np.array_equal(_tokens(store, result), _expected(TEXTS, tok))
    assert result.manifest["tokenizer"]["type"] == "bpe" and store.exists(f"{result.prefix}/tokenizer.json")


def test_two_workers_give_the_same_parts_as_one(tmp_path):
    for i in range(3):
        _jsonl(tmp_path / "in" / f"f{i}.jsonl", TEXTS[i::3])
    one = tokenize_to_npy(
        str(tmp_path / "in"), FileStore(tmp_path / "o1"), "", ByteTokenizer(), shard_tokens=500
    )
    store2 = FileStore(tmp_path / "o2")
    two = tokenize_to_npy(str(tmp_path / "in"), store2, "", ByteTokenizer(), workers=2, shard_tokens=500)
    assert one.prefix == two.prefix and one.manifest == two.manifest
    for p in one.manifest["parts"]:
        assert (tmp_path / "o1" / one.prefix / p["key"]).read_bytes() == (
            tmp_path / "o2" / two.prefix / p["key"]
        ).read_bytes()
    assert two.summary()["peak_rss_mb_per_worker"] > 0


def test_a_second_run_reuses_the_tokens_without_tokenizing(tmp_path, caplog):
    _jsonl(tmp_path / "in" / "a.jsonl", TEXTS)
    store = MemoryStore("reuse")
    first = tokenize_to_npy(str(tmp_path / "in"), store, "c", Counting())
    again = Counting()
    with caplog.at_level("INFO"):
        second = tokenize_to_npy(str(tmp_path / "in"), store, "c", again)
    assert not first.reused and second.reused and again.calls == 0
    assert second.prefix == first.prefix and second.manifest == first.manifest
    assert "reusing" in caplog.text


def test_a_changed_input_or_tokenizer_gives_a_new_prefix(tmp_path):
    _jsonl(tmp_path / "in" / "a.jsonl", TEXTS)
    store = MemoryStore("changed")
    base = tokenize_to_npy(str(tmp_path / "in"), store, "", ByteTokenizer()).prefix
    bpe = tokenize_to_npy(str(tmp_path / "in"), store, "", train_bpe(TEXTS, 300)).prefix
    _jsonl(tmp_path / "in" / "a.jsonl", [*TEXTS[:-1], TEXTS[-1].upper()])  # same size, other bytes
    changed = tokenize_to_npy(str(tmp_path / "in"), store, "", ByteTokenizer()).prefix
    assert len({base, bpe, changed}) == 3


def test_a_crashed_run_resumes_skipping_the_units_it_finished(tmp_path):
    _jsonl(tmp_path / "in" / "a.jsonl", TEXTS[:20])
    _jsonl(tmp_path / "in" / "b.jsonl", [*TEXTS[20:], "boom"])
    store = MemoryStore("crash")
    with pytest.raises(RuntimeError, match="simulated crash"):
        tokenize_to_npy(str(tmp_path / "in"), store, "", Counting(crash_on="boom"))
    assert not [k for k in store.list() if k.endswith("manifest.json")]
    resumed = Counting()
    result = tokenize_to_npy(str(tmp_path / "in"), store, "", resumed)
    assert result.units_skipped == 1 and resumed.calls == 1
    assert np.array_equal(_tokens(store, result), _expected([*TEXTS, "boom"], ByteTokenizer()))


@pytest.mark.parametrize(
    ("files", "message"),
    [
        ({"a.csv": "x"}, "holds no supported files (.txt, .md, .jsonl"),
        ({"a.jsonl": '{"text": "ok"}\nnot json\n'}, "a.jsonl:2: invalid JSON"),
        ({"a.jsonl": '{"body": "x"}\n'}, "a.jsonl:1: no field 'text'"),
        ({"a.jsonl": '["x"]\n'}, "a.jsonl:1: expected a JSON object"),
        ({"a.jsonl": '{"text": 3}\n'}, "a.jsonl:1: field 'text' must be a string"),
        ({"a.txt": b"\xff\xfe".decode("latin-1")}, "a.txt: not UTF-8"),
        ({"a.txt": "  \n", "b.jsonl": '{"text": ""}\n'}, "contains no text"),
    ],
)
def test_bad_inputs_are_one_line_value_errors_naming_the_file_and_line(tmp_path, files, message):
    for name, text in files.items():
        (tmp_path / name).write_bytes(text.encode("latin-1") if name.endswith(".txt") else text.encode())
    with pytest.raises(CorpusError) as e:
        tokenize_to_npy(str(tmp_path), MemoryStore("bad"), "", ByteTokenizer())
    assert isinstance(e.value, ValueError) and message in str(e.value) and "\n" not in str(e.value)


def test_a_parquet_file_without_the_column_and_a_missing_input_are_refused(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "a.parquet")
    with pytest.raises(CorpusError, match=r"a.parquet: no column 'text' \(columns: \['body'\]\); pass"):
        tokenize_to_npy(str(tmp_path), MemoryStore("pq"), "", ByteTokenizer())
    with pytest.raises(CorpusError, match="does not exist"):
        tokenize_to_npy(str(tmp_path / "nope"), MemoryStore("pq"), "", ByteTokenizer())
    with pytest.raises(CorpusError, match="memory:// store lives in one process"):
        tokenize_to_npy(str(tmp_path), MemoryStore("pq"), "", ByteTokenizer(), workers=2)


def test_uint16_up_to_65536_ids_then_uint32_and_nothing_beyond(tmp_path):
    assert token_dtype(258) == np.dtype("<u2") and token_dtype(65536) == np.dtype("<u2")
    assert token_dtype(65537) == np.dtype("<u4") and token_dtype(2**32) == np.dtype("<u4")
    with pytest.raises(CorpusError, match="exceeds uint32"):
        token_dtype(2**32 + 1)
    _jsonl(tmp_path / "a.jsonl", TEXTS)
    store = MemoryStore("wide")
    result = tokenize_to_npy(str(tmp_path), store, "", Counting(vocab_size=70_000))
    raw = store.get(f"{result.prefix}/{result.manifest['parts'][0]['key']}")
    assert raw[:8] == b"\x93NUMPY\x01\x00" and result.manifest["dtype"] == "uint32"
    assert np.array_equal(_tokens(store, result), _expected(TEXTS, ByteTokenizer()))


def test_tokenizer_specs(tmp_path):
    assert isinstance(tokenizer_from_spec("byte"), ByteTokenizer)
    assert isinstance(tokenizer_from_spec("auto"), ByteTokenizer)
    path = tmp_path / "tokenizer.json"
    path.write_text(train_bpe(TEXTS, 300).to_json())
    assert isinstance(tokenizer_from_spec(str(path)), BPETokenizer)
    with pytest.raises(CorpusError, match="--tokenizer bpe: BPE is trained on the whole corpus"):
        tokenizer_from_spec("bpe")
    with pytest.raises(CorpusError, match="needs --model-hf"):
        tokenizer_from_spec("model")


def test_the_tokenize_command_prints_the_prefix_and_a_json_summary(tmp_path, capsys):
    _jsonl(tmp_path / "in" / "a.jsonl", TEXTS)
    argv = [
        "tokenize",
        "--input",
        str(tmp_path / "in"),
        "--out",
        f"file://{tmp_path}/out",
        "--tokenizer",
        "byte",
    ]
    assert main(argv) == 0
    first = capsys.readouterr()
    summary = json.loads(first.out)
    assert summary["documents"] == len(TEXTS) and summary["workers"] == 1 and not summary["reused"]
    assert summary["url"] in first.err and (tmp_path / "out" / summary["prefix"] / "manifest.json").is_file()
    for key in ("tokens", "bytes_in", "seconds", "documents_per_s", "mb_per_s_per_worker"):
        assert key in summary
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["reused"] is True
    assert main([*argv[:-1], "bpe"]) == 2
    assert capsys.readouterr().err.startswith("error: --tokenizer bpe")
