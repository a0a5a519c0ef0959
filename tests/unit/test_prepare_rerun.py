"""prepare run again on a prepared run root (an Argo retry, or the stock retryStrategy re-running the whole
pipeline DAG while the run trains): it verifies and returns, writes nothing, and refuses another config."""

from __future__ import annotations

from pathlib import Path

import pytest

from ddiloco.errors import ConfigError
from ddiloco.run.prepare import config_differences, prepare
from ddiloco.store.url import open_store
from tests._harness import tiny_config

SECRET = bytes.fromhex("5a" * 32)


def _snapshot(root: Path) -> dict[str, tuple[bytes, int]]:
    return {
        str(p.relative_to(root)): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in root.rglob("*")
        if p.is_file()
    }


def test_a_second_prepare_writes_nothing_and_a_different_config_is_refused_by_name(tmp_path):
    url = f"file://{tmp_path}/run"
    meta = prepare(open_store(url), tiny_config("run"), secret=SECRET)
    before = _snapshot(tmp_path / "run")
    assert any(k.startswith("global/") for k in before) and "config.json" in before
    assert prepare(open_store(url), tiny_config("run"), secret=SECRET) == meta  # verified, returned
    assert _snapshot(tmp_path / "run") == before  # not one object rewritten (bytes and mtimes)
    with pytest.raises(ConfigError, match=r"differs in diloco\.fragments, train\.batch_size\); use a new"):
        prepare(
            open_store(url), tiny_config("run", "diloco.fragments=3", "train.batch_size=2"), secret=SECRET
        )
    with pytest.raises(ConfigError, match="another DDILOCO_RUN_KEY"):
        prepare(open_store(url), tiny_config("run"), secret=bytes.fromhex("a5" * 32))
    assert _snapshot(tmp_path / "run") == before


def test_config_differences_names_dotted_keys():
    assert config_differences({"a": {"b": 1, "c": 2}}, {"a": {"b": 1, "c": 3, "d": 0}}) == ["a.c", "a.d"]
    assert config_differences({"a": [1]}, {"a": [1]}) == [] and config_differences(1, 2) == [
        "(the whole config)"
    ]
