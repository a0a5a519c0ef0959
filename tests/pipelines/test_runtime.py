"""`components.runtime`: what every component body calls (command lines, metrics, model pointers)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from components.runtime import (
    RoleFailed,
    command,
    ddiloco,
    flat_numbers,
    last_json,
    log_metrics,
    model_pointer,
    prepare_settings,
    publish_file,
)


class FakeArtifact:
    """Behaves like a KFP output artifact: a path, a metadata dict, log_metric into the metadata."""

    def __init__(self, path: Path) -> None:
        self.path, self.metadata = str(path), {}

    def log_metric(self, name: str, value: float) -> None:
        assert isinstance(value, float)
        self.metadata[name] = value


def test_command_line_of_a_role():
    cmd = command(
        "prepare", store="s3://b/p/r", run_id="r", set=["a=1", "b=2"], device=None, latest=True, n=3
    )
    assert cmd[:4] == [sys.executable, "-m", "ddiloco.cli", "prepare"]
    assert cmd[4:] == [
        "--store",
        "s3://b/p/r",
        "--run-id",
        "r",
        "--set",
        "a=1",
        "--set",
        "b=2",
        "--latest",
        "--n",
        "3",
    ]
    assert command("report", "s3://b/r", out=Path("/o"))[4:] == ["s3://b/r", "--out", "/o"]


def test_prepare_settings_put_the_ui_knobs_last():
    got = prepare_settings(["diloco.learners=9", "diloco.codec=int4"], 4, 2, 5000, " {events: []} ", 8)
    assert got == ["diloco.learners=9", "diloco.codec=int4", "diloco.learners=4", "diloco.quorum=2",
                   "diloco.token_budget=5000", "chaos={events: []}"]  # fmt: skip
    assert prepare_settings([], 1, 0, 0, "", 8) == ["diloco.learners=1"]
    with pytest.raises(ValueError, match="compiled for 1..8"):
        prepare_settings([], 9, 0, 0, "", 8)
    with pytest.raises(ValueError, match="strings like"):
        prepare_settings(["diloco.codec"], 2, 0, 0, "", 8)


def test_results_become_flat_finite_metrics(tmp_path):
    result = {"val_loss": 2.5, "perplexity": 12, "ok": True, "run_id": "r", "nan": float("nan"),
              "task_accuracy": {"qa": 0.5, "math": {"add": 1}}}  # fmt: skip
    assert flat_numbers(result) == {
        "val_loss": 2.5,
        "perplexity": 12.0,
        "task_accuracy.qa": 0.5,
        "task_accuracy.math.add": 1.0,
    }
    m = FakeArtifact(tmp_path / "m")
    log_metrics(m, result, keys=["val_loss", "task_accuracy", "missing"])
    assert m.metadata == {"val_loss": 2.5, "task_accuracy.qa": 0.5, "task_accuracy.math.add": 1.0}
    log_metrics(m, None)  # a role that printed nothing logs nothing
    assert last_json('log line\n{"a": 1}\n\n') == {"a": 1} and last_json("no json") is None
    assert last_json("[1, 2]") is None


def test_model_pointer_names_the_checkpoint_in_the_store(tmp_path):
    model = FakeArtifact(tmp_path / "out" / "model")
    model_pointer(
        model, "s3://bucket/runs/r1/", "final/model.safetensors", {"versions": [1, 2], "tokens_merged": 9.0}
    )
    assert model.metadata["uri"] == "s3://bucket/runs/r1/final/model.safetensors"
    assert model.metadata["tokens_merged"] == 9.0 and "versions" not in model.metadata
    assert json.loads(Path(model.path).read_text()) == model.metadata


def test_publish_file_copies_or_warns(tmp_path):
    (tmp_path / "report.html").write_text("<html></html>")
    html = FakeArtifact(tmp_path / "a" / "html")
    assert publish_file(tmp_path / "report.html", html) and Path(html.path).read_text() == "<html></html>"
    assert not publish_file(tmp_path / "missing.md", FakeArtifact(tmp_path / "b"))


def test_a_failing_role_fails_the_component(tmp_path, capfd):
    with pytest.raises(RoleFailed, match="exited with code 2"):
        ddiloco("prepare", store=f"file://{tmp_path}/run", set=["diloco.nope=1"])
    assert "diloco.nope" in capfd.readouterr().err  # the role's one-line error is in the step's log
