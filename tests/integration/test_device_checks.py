"""`benchmarks/device_checks.sh`, the one command a session with a GPU machine runs, in its quick mode on this
machine: the script must still run every step and leave its files, or the device time goes to fixing it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "device_checks.sh"

pytestmark = pytest.mark.slow


def _run(out: Path, *steps: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "DEVICE_CHECKS_QUICK": "1"}
    return subprocess.run(
        ["bash", str(SCRIPT), *steps], cwd="/", env=env, capture_output=True, text=True, timeout=300
    )


def test_quick_mode_runs_the_tests_and_a_benchmark_and_leaves_their_files(tmp_path: Path) -> None:
    proc = _run(tmp_path, "tests", "llama-350m")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    versions = json.loads((tmp_path / "versions.json").read_text())
    assert versions["torch"] and "transformers" in versions and versions["gpus"] >= 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["quick"] is True
    assert [summary[s]["exit"] for s in ("tests", "llama-350m")] == [0, 0]
    assert "gpt-350m" not in summary  # only the steps asked for
    assert (tmp_path / "tests.xml").read_text().startswith("<?xml") and summary["tests"]["result"] is None
    bench = summary["llama-350m"]["result"]  # the benchmark's JSON line
    assert bench["model"] == "llama" and bench["preset"] == "tiny"
    assert len(list(tmp_path.iterdir())) <= 8  # what a device call brings back: 8 files at most
    assert bench["tokens_per_s_learner"] > 0 and bench["tokens_per_s_plain"] > 0


def test_an_unknown_step_is_refused_by_name(tmp_path: Path) -> None:
    proc = _run(tmp_path, "gpt-1b")
    assert proc.returncode == 102
    assert "unknown step gpt-1b (choose tests, gpt-350m, llama-350m)" in proc.stderr
