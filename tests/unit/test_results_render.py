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


def _parity_out(commit: str, gaps: list[float], updown: list[float]) -> dict:
    """What `parity.py --json` writes, reduced to what `parity_claim.py` reads."""
    rows = [
        {"method": "decoupled", "seed": s, "loss_vs_dp_pct": g, "bytes_x_vs_dp": 400.0 + s,
         "total_bytes_x_vs_dp": u, "tokens_processed": 43.5e6}
        for s, (g, u) in enumerate(zip(gaps, updown, strict=True))
    ]  # fmt: skip
    agg = {"method": "decoupled", "loss_vs_dp_pct": sum(gaps) / len(gaps), "loss_vs_dp_pct_std": 0.18}
    return {
        "argv": "benchmarks/parity.py --tokens 40000000",
        "commit": commit,
        "machine": {"cpus": 2, "cpu": "X", "loadavg": [3.0, 4.0, 5.0], "loadavg_end": [9.5, 8.0, 7.0]},
        "methods": rows,
        "aggregate": {"methods": [{"method": "dp"}, agg]},
    }


def test_a_claim_is_made_from_parity_results_with_their_command_commit_and_load(tmp_path: Path):
    (tmp_path / "quality.json").write_text(json.dumps({"headline": "gap {syn} and {doc}", "order": 3}))
    paths = []
    for name, gaps in (("syn", [0.29, 0.44, 0.08]), ("doc", [-0.30, -0.28, -0.64])):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(_parity_out("abc123", gaps, [518.4, 522.2, 520.0])))
    cmd = [sys.executable, str(ROOT / "benchmarks" / "parity_claim.py"), "quality", "--folder", str(tmp_path)]
    runs = ["--run", f"syn={paths[0]}", "--run", f"doc={paths[1]}"]
    out = subprocess.run([*cmd, *runs], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    doc = json.loads((tmp_path / "quality.json").read_text())
    assert doc["headline"] == "gap {syn} and {doc}"  # kept
    f = doc["figures"]
    assert (f["syn"], f["doc"]) == ("+0.27% ± 0.18", "\u22120.41% ± 0.18")
    assert (f["syn_seeds"], f["syn_updown_x"], f["syn_up_x"], f["syn_tokens"]) == (
        3,
        "518\u2013522×",
        401.0,
        "43.5M",
    )
    assert doc["commit"] == "abc123" and doc["machine"]["loadavg"] == "3.0\u20139.5"
    assert doc["command"].count("benchmarks/parity.py") == 2
    # Runs of two different commits are not one claim; a result without its argv is refused.
    paths[1].write_text(json.dumps(_parity_out("def456", [0.1], [500.0])))
    out = subprocess.run([*cmd, *runs], capture_output=True, text=True)
    assert out.returncode == 2 and "different commits" in out.stderr
    old = _parity_out("abc123", [0.1], [500.0])
    del old["argv"]
    paths[1].write_text(json.dumps(old))
    out = subprocess.run([*cmd, *runs], capture_output=True, text=True)
    assert out.returncode == 2 and "from before it wrote them" in out.stderr
