"""Figures are data (issue 50): the README's headline figures and docs/results.md's current-figures table are
what `benchmarks/render_results.py` renders from docs/results/*.json, and a benchmark's `--record` writes
such a file with its command, commit, machine and date."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _module(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


render = _module("render_results")
record = _module("_record")


def test_the_committed_text_is_what_the_result_files_render():
    for path, text in render.rendered().items():
        assert path.read_text() == text, f"{path.name} is stale: run benchmarks/render_results.py"


def test_the_check_command_fails_on_a_changed_figure(tmp_path: Path):
    copy = tmp_path / "repo"
    (copy / "docs").mkdir(parents=True)
    shutil.copytree(ROOT / "docs" / "results", copy / "docs" / "results")
    shutil.copy(ROOT / "docs" / "results.md", copy / "docs" / "results.md")
    shutil.copy(ROOT / "README.md", copy / "README.md")
    assert all(p.read_text() == t for p, t in render.rendered(copy).items())
    soak = copy / "docs" / "results" / "soak.json"
    doc = json.loads(soak.read_text())
    doc["figures"]["faults_per_hour"] = 999.9
    soak.write_text(json.dumps(doc))
    stale = {p.name for p, t in render.rendered(copy).items() if p.read_text() != t}
    assert stale == {"README.md", "results.md"}
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "render_results.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr  # the real tree is current


def test_every_claim_says_where_when_and_on_what_it_was_measured():
    docs = render.claims()
    assert {d["claim"] for d in docs} >= {"soak", "bytes", "quality", "trust", "storage", "simulation"}
    for d in docs:
        assert d["command"] and d["commit"] and d["measured_at"][:4] == "2026", d["claim"]
        assert d["headline"].format(**d["figures"]) and d["figure"].format(**d["figures"])
    older = [d for d in docs if d.get("older_code")]
    readme = (ROOT / "README.md").read_text()
    assert all(f"at {d['commit']}, on older code" in readme for d in older)


def test_a_benchmark_records_its_result_with_command_commit_and_machine(tmp_path: Path, monkeypatch):
    (tmp_path / "c.json").write_text(json.dumps({"headline": "h {x}", "order": 9, "title": "T"}))
    monkeypatch.setattr(sys, "argv", ["benchmarks/x.py", "--record", "c", "--tokens", "10"])
    path = record.record("c", {"x": 1.5}, {"raw": [1, 2]}, folder=tmp_path)
    doc = json.loads(path.read_text())
    assert doc["headline"] == "h {x}" and doc["order"] == 9  # kept from the file it replaces
    assert doc["command"] == "benchmarks/x.py --record c --tokens 10" and doc["figures"] == {"x": 1.5}
    assert set(doc["machine"]) == {"cpus", "cpu", "loadavg"} and doc["output"] == {"raw": [1, 2]}
    assert doc["commit"] == "unknown" or len(doc["commit"].split("-")[0]) == 12


@pytest.mark.parametrize("bench", ["parity", "soak", "syncer_scale"])
def test_the_headline_benchmarks_take_record(bench: str):
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / f"{bench}.py"), "--help"], capture_output=True, text=True
    )
    assert out.returncode == 0 and "--record CLAIM" in out.stdout, out.stderr[-2000:]


def test_a_claim_naming_a_figure_it_lacks_says_which():
    doc = {"claim": "c", "figures": {"a": 1}}
    with pytest.raises(ValueError, match="claim c: its text names 'b'"):
        render.fill(doc, "{a} {b}")
