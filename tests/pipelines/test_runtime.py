"""`ddiloco.components.runtime` and its neighbours: what the component bodies call (command lines, metrics,
the first step's parameter check, model cards, store prefixes copied for lm-eval)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from ddiloco.components.runtime import (
    RoleFailed,
    command,
    ddiloco,
    flat_numbers,
    last_json,
    log_metrics,
    prepare_settings,
    publish_file,
    tokenize_finish,
    tokenize_plan,
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
    def settings(overrides, learners, quorum=0, token_budget=0, chaos="", **more):
        given = {"overrides": overrides, "learners": learners, "quorum": quorum, "token_budget": token_budget}
        return prepare_settings({**given, "chaos": chaos, "max_learners": 8, **more})

    got = settings(["diloco.learners=9", "diloco.codec=int4"], 4, 2, 5000, " {events: []} ")
    assert got == ["diloco.max_learners=8", "diloco.learners=9", "diloco.codec=int4", "diloco.learners=4",
                   "diloco.quorum=2", "diloco.token_budget=5000", "chaos={events: []}"]  # fmt: skip
    assert settings([], 1) == ["diloco.max_learners=8", "diloco.learners=1"]
    assert settings([], 1, 0.0, 400000.0)[-1] == "diloco.token_budget=400000"  # a compiled default's float
    hf = settings(["model.hf=s3://b/old"], 1, model_hf=" s3://models/qwen3 ")
    assert hf[-1] == "model.hf=s3://models/qwen3"  # the UI's model parameter wins over an override
    data = settings(["data.source=old.jsonl"], 1, corpus=" s3://b/corpora/corpus-1 ")
    assert data[-1] == "data.source=s3://b/corpora/corpus-1"  # the tokenize step's corpus wins too
    assert tokenize_plan({"store": "s3://b/p", "corpus": " s3://b/tokens "}) == ([], "s3://b/tokens", False)
    assert tokenize_plan({"store": "s3://b/p"}) == ([], "", False)  # neither: the recipe's data
    assert tokenize_finish("s3://b/tokens", False) == "s3://b/tokens"  # nothing tokenized: nothing to finish
    with pytest.raises(ValueError, match="not both"):
        tokenize_plan({"store": "s3://b/p", "text_corpus": "s3://b/text", "corpus": "s3://b/tokens"})
    with pytest.raises(ValueError, match="compiled for 1..8"):
        settings([], 9)
    with pytest.raises(ValueError, match="strings like"):
        settings(["diloco.codec"], 2)


def test_the_first_step_refuses_a_misspelt_override_with_the_did_you_mean_before_anything_else():
    """A run started from the KFP UI: tokenize-plan checks the parameters as prepare will use them."""
    from ddiloco.components.roles import tokenize_plan as first_step

    from ddiloco.errors import ConfigError

    run = {"recipe": "tiny-cpu", "overrides": ["diloco.sync_evry=8"], "max_learners": 8}
    with pytest.raises(ConfigError, match="did you mean 'diloco.sync_every'"):  # no store touched first
        tokenize_plan({**run, "store": "s3://nowhere/p", "text_corpus": "s3://nowhere/text"})
    with pytest.raises(ValueError, match="compiled for 1..8"):
        tokenize_plan({**run, "store": "s3://b/p", "overrides": [], "learners": 9})
    assert tokenize_plan(
        {**run, "store": "s3://b/p", "corpus": "s3://b/t", "overrides": ["diloco.sync_every=8"]}
    )[1]
    with pytest.raises(ConfigError, match="unknown recipe"):  # the component body passes every parameter
        first_step(store="s3://b/p", recipe="nope", learners=2, max_learners=8)
    assert first_step(store="s3://b/p").corpus == ""  # no recipe (by hand): nothing to check


def test_a_model_card_keeps_what_the_run_wrote_and_leaves_out_the_rest():
    from ddiloco.components.models import model_card

    printed = {"architecture": "GPT2LMHeadModel", "parameters": 1234, "files": ["config.json"]}
    docs = {"final": {"tokens_merged": 9000.0}, "sft": {"steps": 20, "train_items": 36}}
    card = model_card("sft", "s3://b/p/run", printed, docs, {"val_loss": 2.5, "perplexity": float("inf")})
    assert card == {
        "format": "huggingface", "framework": "transformers", "checkpoint": "sft", "present": True,
        "run_root": "s3://b/p/run", "architecture": "GPT2LMHeadModel", "parameters": 1234,
        "files": ["config.json"], "tokens_trained": 9000.0, "sft_steps": 20, "sft_examples": 36,
        "val_loss": 2.5,
    }  # fmt: skip
    bare = model_card("final", "s3://b/p/run", {}, {"final": None}, None)
    assert "val_loss" not in bare and "tokens_trained" not in bare and "sft_steps" not in bare


def test_a_store_prefix_is_copied_with_its_layout_and_an_empty_one_is_refused(tmp_path):
    from ddiloco.components.evaluation import copy_prefix

    from ddiloco.store.url import open_store

    src = open_store((tmp_path / "tasks").as_uri())
    src.put("mine/mine.yaml", b"task: mine\n")
    src.put("mine/data/test.jsonl", b"{}\n")
    out = copy_prefix(src.url, tmp_path / "copy")
    assert (out / "mine" / "mine.yaml").read_text() == "task: mine\n" and (
        out / "mine/data/test.jsonl"
    ).exists()
    with pytest.raises(ValueError, match="holds no objects"):
        copy_prefix((tmp_path / "empty").as_uri(), tmp_path / "copy2")


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


def test_publish_file_copies_or_warns(tmp_path):
    (tmp_path / "report.html").write_text("<html></html>")
    html = FakeArtifact(tmp_path / "a" / "html")
    assert publish_file(tmp_path / "report.html", html) and Path(html.path).read_text() == "<html></html>"
    assert not publish_file(tmp_path / "missing.md", FakeArtifact(tmp_path / "b"))


def test_a_failing_role_fails_the_component(tmp_path, capfd):
    with pytest.raises(RoleFailed, match="exited with code 2"):
        ddiloco("prepare", store=f"file://{tmp_path}/run", set=["diloco.nope=1"])
    assert "diloco.nope" in capfd.readouterr().err  # the role's one-line error is in the step's log


# --- the run root, in-pod restarts and the exit-handler report (issue 14) ---------------------------------
def test_the_run_root_joins_base_and_run_id_and_expands_the_namespace(monkeypatch):
    from ddiloco.components.runtime import NAMESPACE_ENV, run_root

    assert run_root("s3://b/p", "3f2a") == "s3://b/p/3f2a"
    assert run_root("file:///tmp/run") == "file:///tmp/run"  # no run id: the store is the run root
    monkeypatch.setenv(NAMESPACE_ENV, "team-a")
    assert run_root("s3://mlpipeline/private/{namespace}/ddiloco", "r1") == (
        "s3://mlpipeline/private/team-a/ddiloco/r1"
    )
    monkeypatch.delenv(NAMESPACE_ENV)
    with pytest.raises(ValueError, match="DDILOCO_K8S_NAMESPACE is not set"):
        run_root("s3://mlpipeline/private/{namespace}/ddiloco", "r1")
    for bad in ("a/b", "..", " r"):
        with pytest.raises(ValueError, match="one path segment"):
            run_root("s3://b/p", bad)


def test_an_unresolved_kfp_placeholder_is_refused_with_what_to_do():
    """What today's YAML delivered on a real KFP 2.17 cluster: the literal placeholder (driver resolve.go)."""
    from ddiloco.components.runtime import run_root

    with pytest.raises(ValueError, match="Recompile the pipeline"):
        run_root("s3://mlpipeline/ddiloco/{{$.pipeline_job_uuid}}")
    with pytest.raises(ValueError, match="unresolved KFP placeholder"):
        run_root("s3://mlpipeline/ddiloco", "{{$.pipeline_job_uuid}}")


def _fake_role(tmp_path, monkeypatch, script: str):
    """`python -m ddiloco.cli ROLE` replaced by a script that counts its runs in tmp_path/runs."""
    import ddiloco.components.runtime as rt

    prog = tmp_path / "role.py"
    prog.write_text(script)
    monkeypatch.setattr(rt, "command", lambda role, *a, **f: [sys.executable, str(prog), str(tmp_path)])


def test_a_crashed_role_is_restarted_in_its_pod_and_its_result_returned(tmp_path, monkeypatch):
    from ddiloco.components.runtime import ddiloco

    _fake_role(tmp_path, monkeypatch, (
        "import json, os, pathlib, signal, sys\n"
        "runs = pathlib.Path(sys.argv[1]) / 'runs'\n"
        "n = int(runs.read_text()) + 1 if runs.exists() else 1\n"
        "runs.write_text(str(n))\n"
        "if n == 1: os.kill(os.getpid(), signal.SIGKILL)\n"  # an OOM kill
        "if n == 2: sys.exit(1)\n"  # a crash
        "print(json.dumps({'run': n}))\n"
    ))  # fmt: skip
    assert ddiloco("learner", restarts=2, restart_delay_s=0.01) == {"run": 3}


def test_a_usage_error_is_not_restarted_and_restarts_are_bounded(tmp_path, monkeypatch):
    from ddiloco.components.runtime import RoleFailed, ddiloco

    _fake_role(tmp_path, monkeypatch, (
        "import pathlib, sys\n"
        "runs = pathlib.Path(sys.argv[1]) / 'runs'\n"
        "runs.write_text(str(int(runs.read_text()) + 1 if runs.exists() else 1))\n"
        "sys.exit(int((pathlib.Path(sys.argv[1]) / 'code').read_text()))\n"
    ))  # fmt: skip
    (tmp_path / "code").write_text("2")
    with pytest.raises(RoleFailed, match="code 2"):
        ddiloco("syncer", restarts=5, restart_delay_s=0.01)
    assert (tmp_path / "runs").read_text() == "1"
    (tmp_path / "runs").unlink()
    (tmp_path / "code").write_text("3")
    with pytest.raises(RoleFailed, match="code 3"):
        ddiloco("syncer", restarts=2, restart_delay_s=0.01)
    assert (tmp_path / "runs").read_text() == "3"


class _Artifact:
    def __init__(self, path):
        self.path, self.metadata, self.metrics = str(path), {}, {}

    def log_metric(self, name, value):
        self.metrics[name] = value


def test_a_run_that_failed_before_prepare_still_gets_its_report(tmp_path):
    """The report step is the exit handler: its artifacts exist even when there is nothing to report."""
    from ddiloco.components.runtime import run_report

    html, md, summary = (_Artifact(tmp_path / n) for n in ("report.html", "summary.md", "metrics"))
    run_report(f"file://{tmp_path}/never-prepared", html, md, summary)
    page, text = Path(html.path).read_text(), Path(md.path).read_text()
    assert "incomplete" in page and "<table>" in page
    assert "| prepared (config.json) | no |" in text and "ddiloco summary --store" in text
    assert summary.metrics == {"run_complete": 0.0, "stages_reached": 0.0}
