"""The `python-docs` corpus (`ddiloco.data.corpora`, `ddiloco.data.pydocs`): offline, deterministic, real prose, usable.

The text comes from the interpreter running the tests, so the checks are on properties (sizes, a sentence of
the Language Reference every CPython 3 ships, byte-identical rewrites), not on a fixed checksum.
"""

import hashlib
import json

import pytest

from ddiloco.cli.main import main as cli_main
from ddiloco.data.corpora import read_meta, sidecar_path, write_python_docs
from ddiloco.data.loader import load_texts
from ddiloco.run.prepare import prepare
from ddiloco.store.url import open_store
from tests._harness import tiny_config

ASSERT_PROSE = "Assert statements are a convenient way to insert debugging assertions"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "python-docs.jsonl"
    return path, write_python_docs(path)


def test_two_builds_are_byte_identical_and_the_sidecar_names_the_text(corpus, tmp_path, capsys):
    path, meta = corpus
    again = tmp_path / "again.jsonl"
    assert cli_main(["corpus", "python-docs", "--out", str(again)]) == 0
    assert again.read_bytes() == path.read_bytes()
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed["sha256"] == meta["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert read_meta(path) == meta and sidecar_path(path).name == "python-docs.jsonl.meta.json"
    assert (
        meta["python"] and meta["implementation"] and meta["license"].startswith("text shipped with CPython")
    )


def test_it_holds_the_help_topics_and_the_stdlib_docstrings(corpus):
    path, meta = corpus
    docs = [json.loads(line) for line in path.read_text().splitlines()]
    ids = [d["id"] for d in docs]
    assert len(ids) == len(set(ids)) == meta["documents"]
    assert meta["topics"] >= 70 and meta["module_documents"] >= 300
    assert meta["characters"] > 1_000_000
    by_id = {d["id"]: d["text"] for d in docs}
    assert ASSERT_PROSE in by_id["topic/assert"]
    assert by_id["module/json"].startswith("json\n\nJSON (JavaScript Object Notation)")
    assert "json.dumps\n\nSerialize ``obj`` to a JSON formatted ``str``." in by_id["module/json"]
    # Never imported: side effects, GUI toolkits, pickled grammars.
    assert not {"module/this", "module/antigravity", "module/tkinter", "module/lib2to3"} & set(by_id)
    # Mixed order (by the id's hash): prose and docstrings in every quarter of the stream.
    for q in range(4):
        quarter = ids[q * len(ids) // 4 : (q + 1) * len(ids) // 4]
        assert any(i.startswith("topic/") for i in quarter) and any(i.startswith("module/") for i in quarter)


def test_the_name_must_say_jsonl(tmp_path):
    with pytest.raises(ValueError, match=r"\*\.jsonl"):
        write_python_docs(tmp_path / "python-docs.txt")


def test_a_run_prepares_from_it(corpus):
    path, meta = corpus
    assert sum(map(len, load_texts(str(path)))) == meta["characters"]
    cfg = tiny_config("pydocs", f"data.source={path}")
    data = prepare(open_store("memory://corpus-pydocs"), cfg)
    # Byte tokenizer: one token per UTF-8 byte plus one eos per document.
    assert sum(data["shard_tokens"]) + data["val_tokens"] == meta["text_utf8_bytes"] + meta["documents"]
    assert data["source"] == str(path) and "entropy_floor" not in data
