"""Every `ddiloco` subcommand through the real entry point (the console script in a subprocess), for real at
a tiny size where that needs no cluster; one shared finished run (`tests._cli.cli_run`) keeps it cheap.

A function test calls the code behind a command; only these see what the user sees: the parser, the
output helper, the exit code (`ddiloco summary` crashed in `emit` while every function test passed).
`pipeline submit` and `pipeline schedule` need a KFP API: here they are run against no server and must say so
in one line (the twin tests in tests/twin run the compiled pipelines).
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
from importlib.metadata import version
from pathlib import Path

import pytest

from tests._cli import ROOT, SCRUB, TINY_RUN_SETS, CliRun, cli_env, ddiloco, entry_point

pytestmark = pytest.mark.slow

# Every subcommand (nested ones as "pipeline submit") -> the tests below that run it.
COVERED = {
    "--version": "test_version_names_the_version_and_the_commit",
    "run": "test_run_prints_where_its_summary_is",
    "summary": "test_summary_prints_the_run_summary_as_json",
    "prepare": "test_keys_gives_a_learner_a_share_that_answers_but_cannot_publish",
    "syncer": "test_keys_gives_a_learner_a_share_that_answers_but_cannot_publish",
    "learner": "test_keys_gives_a_learner_a_share_that_answers_but_cannot_publish",
    "evaluate": "test_evaluate_sft_export_and_report_on_the_run",
    "sft": "test_evaluate_sft_export_and_report_on_the_run",
    "export": "test_evaluate_sft_export_and_report_on_the_run",
    "report": "test_evaluate_sft_export_and_report_on_the_run",
    "logs": "test_logs_lists_and_prints_the_shipped_logs",
    "chaos": "test_chaos_with_no_events_exits_at_once",
    "baseline": "test_baseline_trains_data_parallel_on_the_run",
    "simulate goodput": "test_simulate_from_the_run_summary",
    "simulate bandwidth": "test_simulate_from_the_run_summary",
    "corpus python-docs": "test_corpus_and_tokenize_write_their_outputs",
    "tokenize": "test_corpus_and_tokenize_write_their_outputs",
    "keys": "test_keys_gives_a_learner_a_share_that_answers_but_cannot_publish",
    "pipeline compile": "test_pipeline_compile_writes_the_package",
    "pipeline submit": "test_pipeline_commands_without_a_kfp_api_fail_in_one_line",
    "pipeline schedule create": "test_pipeline_commands_without_a_kfp_api_fail_in_one_line",
    "pipeline schedule list": "test_pipeline_commands_without_a_kfp_api_fail_in_one_line",
    "pipeline schedule disable": "test_pipeline_commands_without_a_kfp_api_fail_in_one_line",
    "pipeline schedule enable": "test_pipeline_commands_without_a_kfp_api_fail_in_one_line",
}


def _leaf_commands(parser, prefix: str = "") -> set[str]:
    import argparse

    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        return {prefix}
    return {
        name
        for sub in subs
        for choice, p in sub.choices.items()
        for name in _leaf_commands(p, f"{prefix} {choice}".strip())
    }


def ok(out: subprocess.CompletedProcess[str]) -> str:
    assert out.returncode == 0, (out.args, out.stderr[-3000:])
    return out.stdout


def test_every_subcommand_has_an_entry_point_test():
    from ddiloco.cli.main import build_parser

    assert _leaf_commands(build_parser()) | {"--version"} == set(COVERED)
    assert set(COVERED.values()) <= set(globals()), set(COVERED.values()) - set(globals())


def test_version_names_the_version_and_the_commit():
    out = ok(ddiloco("--version")).strip()
    m = re.fullmatch(r"ddiloco (\S+) \(commit (\S+)\)", out)
    assert m is not None, out
    assert m[1] == version("ddiloco")
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    if (ROOT / ".git").exists() and head.returncode == 0:
        assert re.fullmatch(r"[0-9a-f]{12}(-dirty)?", m[2]) and head.stdout.startswith(m[2][:12]), (
            m[2],
            head.stdout,
        )
    else:
        assert m[2] == "unknown"


def test_run_prints_where_its_summary_is(cli_run: CliRun):
    summary = cli_run.root / "summary.json"
    assert cli_run.result.stdout.strip() == str(summary)
    s = json.loads(summary.read_text())
    assert s["status"] == "done"
    assert "ledger balanced" in cli_run.result.stderr
    assert 0 < s["mfu"] < 1 and s["peak_memory_kind"] == "peak_rss" and s["peak_memory_bytes"] > 0
    assert f"MFU {100 * s['mfu']:.1f}%" in cli_run.result.stderr  # the outcome, from the stated peak


def test_run_writes_tensorboard_runs_for_every_role(cli_run: CliRun):
    """Issue 52: TensorBoard's own reader finds, under the run root's tb/, the global model's validation loss
    at ≥ 5 published versions (by tokens merged), every learner's loss, the syncer's rounds; the summary and
    the report point at the prefix."""
    from tests.unit.test_tracking import scalars_read_by_tensorboard

    tb = cli_run.root / "tb"
    assert {p.name for p in tb.iterdir()} == {"syncer", "learner-0", "learner-1", "posttrain"}
    curve = scalars_read_by_tensorboard(tb / "posttrain")["global/val_loss"]
    steps = [s for s, _ in curve]
    assert len(curve) >= 5 and steps == sorted(set(steps)) and curve[-1][1] < curve[0][1], curve
    for learner in ("learner-0", "learner-1"):
        losses = scalars_read_by_tensorboard(tb / learner)["train/loss"]
        assert len(losses) >= 5 and all(v > 0 for _, v in losses), learner
    syncer = scalars_read_by_tensorboard(tb / "syncer")
    assert syncer["round/quorum"] and syncer["global/tokens_merged"][-1][1] >= 6000
    tracking = json.loads((cli_run.root / "summary.json").read_text())["tracking"]
    assert tracking["tensorboard"] == f"{cli_run.url}/tb/" and not any(tracking["dropped_events"].values())
    assert f"{cli_run.url}/tb/" in (cli_run.root / "report" / "report.html").read_text()


def test_summary_prints_the_run_summary_as_json(cli_run: CliRun):
    summary = json.loads(ok(ddiloco("summary", "--store", cli_run.url, env=cli_run.env())))
    assert summary["ledger_balanced"] is True and summary["run_id"] == "r"


@pytest.mark.long  # the same roles by hand through the entry point: test_keys_gives_a_learner_a_share_...
# (signed) and tests/integration/test_docs_commands.py's docs/guide.md:130 block (unsigned, these arguments)
def test_prepare_syncer_and_learner_make_a_run_by_hand(tmp_path: Path):
    """docs/guide.md's roles by hand: prepare, then a syncer and a learner as separate processes."""
    url = (tmp_path / "h").as_uri()
    small = ("--set", "diloco.learners=1", "--set", "diloco.token_budget=2000")
    meta = json.loads(ok(ddiloco("prepare", "--store", url, *TINY_RUN_SETS, *small)))
    assert meta["run_id"] == "h" and sum(meta["shard_tokens"]) > 2000
    syncer = subprocess.Popen(
        [*entry_point(), "syncer", "--store", url],
        env=cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        ok(ddiloco("learner", "--store", url, "--learner-id", "0", timeout=180))
        assert syncer.wait(timeout=60) == 0, syncer.communicate()[1][-3000:]
    finally:
        syncer.kill()
        syncer.communicate()
    summary = json.loads(ok(ddiloco("summary", "--store", url)))
    assert summary["status"] == "done" and summary["ledger_balanced"] and summary["tokens_merged"] >= 2000


def test_keys_gives_a_learner_a_share_that_answers_but_cannot_publish(tmp_path: Path):
    """`ddiloco keys` prints a learner's share of the master key: a learner process holding only that share
    trains and is merged (the syncer holds the master key), and a syncer given only the share refuses to
    start, in one line (issue 49: keys per role). Also docs/guide.md's roles by hand through the entry point:
    prepare, then a syncer and a learner as separate processes, the run done and balanced."""
    master = "ab" * 32
    share = json.loads(ok(ddiloco("keys", env=cli_env(DDILOCO_RUN_KEY=master))))["env"]
    assert set(share) == {"DDILOCO_LEARNER_KEY", "DDILOCO_SYNCER_PUBKEY"} and master not in share.values()
    url = (tmp_path / "k").as_uri()
    small = ("--set", "diloco.learners=1", "--set", "diloco.token_budget=2000")
    meta = json.loads(
        ok(ddiloco("prepare", "--store", url, *TINY_RUN_SETS, *small, env=cli_env(DDILOCO_RUN_KEY=master)))
    )
    assert meta["run_id"] == "k" and sum(meta["shard_tokens"]) > 2000
    refused = ddiloco("syncer", "--store", url, env=cli_env(**share))
    assert refused.returncode == 2 and "needs DDILOCO_RUN_KEY" in refused.stderr.strip().splitlines()[-1]
    syncer = subprocess.Popen(
        [*entry_point(), "syncer", "--store", url],
        env=cli_env(DDILOCO_RUN_KEY=master),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        ok(ddiloco("learner", "--store", url, "--learner-id", "0", env=cli_env(**share), timeout=180))
        assert syncer.wait(timeout=60) == 0, syncer.communicate()[1][-3000:]
    finally:
        syncer.kill()
        syncer.communicate()
    summary = json.loads(ok(ddiloco("summary", "--store", url)))
    assert summary["status"] == "done" and summary["ledger_balanced"] and not summary["rejected_updates"]
    assert summary["tokens_merged"] >= 2000


def test_evaluate_sft_export_and_report_on_the_run(cli_run: CliRun, tmp_path: Path):
    env = cli_run.env()
    evaluated = json.loads(
        ok(ddiloco("evaluate", "--store", cli_run.url, "--name", "entry", "--items", "4", env=env))
    )
    assert evaluated["model"] == "final" and evaluated["val_loss"] > 0
    assert (cli_run.root / "eval" / "entry.json").is_file()
    sft = json.loads(ok(ddiloco("sft", "--store", cli_run.url, "--steps", "2", env=env)))
    assert sft["base"]["model"] == "final" and sft["final_loss"] > 0
    exported = json.loads(
        ok(ddiloco("export", "--store", cli_run.url, "--out", str(tmp_path / "hf"), env=env))
    )
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(exported["files"])
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    report = json.loads(ok(ddiloco("report", cli_run.url, "--out", str(tmp_path / "rep"), env=env)))
    assert Path(report["html"]).is_file() and Path(report["markdown"]).is_file()


def test_logs_lists_and_prints_the_shipped_logs(cli_run: CliRun):
    listing = ok(ddiloco("logs", "--store", cli_run.url))
    assert "logs/syncer/" in listing and "logs/learner/" in listing
    tail = ok(ddiloco("logs", "--store", cli_run.url, "--role", "syncer", "--tail", "3"))
    assert tail.startswith("==> logs/syncer/") and len(tail.splitlines()) <= 1 + 3 * len(listing.splitlines())


def test_chaos_with_no_events_exits_at_once(cli_run: CliRun):
    out = ddiloco(
        "chaos", "--store", cli_run.url, "--backend", "local", "--max-seconds", "5", env=cli_run.env()
    )
    ok(out)
    assert "0 event(s) recorded" in out.stderr


def test_baseline_trains_data_parallel_on_the_run(cli_run: CliRun):
    args = ("baseline", "--store", cli_run.url, "--learners", "1", "--tokens", "2000", "--no-tasks")
    result = json.loads(ok(ddiloco(*args, env=cli_run.env(), timeout=180)))
    assert result["backend"] == "gloo" and result["final_val_loss"] < result["initial_val_loss"]


def test_simulate_from_the_run_summary(cli_run: CliRun):
    grid = json.loads(ok(ddiloco("simulate", "goodput", "--json", "--chips", "40k", "--learners", "2")))
    assert {row["method"] for row in grid["rows"]} >= {"dp"} and all(
        0 < r["goodput"] <= 1 for r in grid["rows"]
    )
    table = ok(ddiloco("simulate", "bandwidth", "--from-summary", str(cli_run.root / "summary.json")))
    assert "params 29920" in table and "decoupled" in table


def test_corpus_and_tokenize_write_their_outputs(tmp_path: Path):
    meta = json.loads(ok(ddiloco("corpus", "python-docs", "--out", str(tmp_path / "pd.jsonl"))))
    assert meta["documents"] > 100 and (tmp_path / "pd.jsonl").stat().st_size == meta["bytes"]
    (tmp_path / "t.txt").write_text("hello world\n")
    args = ("tokenize", "--input", str(tmp_path / "t.txt"), "--out", (tmp_path / "tok").as_uri())
    plan = json.loads(ok(ddiloco(*args)))
    assert (
        plan["documents"] == 1 and plan["tokens"] > 0 and plan["url"].startswith((tmp_path / "tok").as_uri())
    )


def test_pipeline_compile_writes_the_package(tmp_path: Path):
    pytest.importorskip("kfp")
    out = ok(
        ddiloco(
            "pipeline",
            "compile",
            "--pipeline",
            "smoke",
            "--registry",
            "r.example/x",
            "--out",
            "s.yaml",
            cwd=tmp_path,
        )
    )
    assert out.strip() == "s.yaml" and "r.example/x" in (tmp_path / "s.yaml").read_text()


def _one_error_line(out: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert out.returncode == 2 and "Traceback" not in out.stderr and len(lines) == 1, out.stderr[-3000:]
    return lines[0]


def test_pipeline_commands_without_a_kfp_api_fail_in_one_line(tmp_path: Path):
    pytest.importorskip("kfp")
    (tmp_path / "p.yaml").write_text("root: {}\n")  # a package with no parameters: nothing is compiled
    no_api = ("--host", "http://127.0.0.1:9")  # nothing listens on the discard port
    for args in (
        ("submit", "--package", "p.yaml", *no_api),
        ("schedule", "create", "--name", "n", "--cron", "0 0 2 * * *", "--package", "p.yaml", *no_api),
        ("schedule", "list", *no_api),
        ("schedule", "disable", "rr-1", *no_api),
    ):
        line = _one_error_line(ddiloco("pipeline", *args, cwd=tmp_path))
        assert line.startswith("error: no KFP API answers at http://127.0.0.1:9") and "KFP_HOST" in line, args
    line = _one_error_line(ddiloco("pipeline", "schedule", "enable", "rr-1", cwd=tmp_path))
    assert "no KFP host: pass --host URL or set KFP_HOST" in line


def test_pipeline_commands_refuse_a_misspelt_override_before_writing_or_sending_anything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
):
    """Issue 52: `diloco.sync_evry=8` fails at compile / submit / schedule time with the prepare step's own
    did-you-mean, exit 2: no package is written, no KFP API is asked (nothing listens at the host).
    In-process through `ddiloco.cli.main.main` (parser, error line, exit code): the entry point of these
    subcommands is run by the tests above; this one is about the check, not the console script."""
    pytest.importorskip("kfp")
    from ddiloco.cli.main import main

    monkeypatch.chdir(tmp_path)
    # main() configures logging: on copies, so that nothing of it outlives this test
    monkeypatch.setattr(logging.root, "handlers", list(logging.root.handlers))
    monkeypatch.setattr(logging.root, "level", logging.root.level)
    for name in [k for k in os.environ if k.startswith(SCRUB)]:
        monkeypatch.delenv(name)

    def run(*argv: str) -> subprocess.CompletedProcess[str]:
        code = main(list(argv))
        out = capsys.readouterr()
        return subprocess.CompletedProcess(argv, code, out.out, out.err)

    bad = ("--param", "overrides=[diloco.sync_evry=8]")
    no_api = ("--host", "http://127.0.0.1:9")
    for args in (
        ("compile", "--pipeline", "smoke", "--out", "s.yaml", *bad),
        ("submit", "--package", str(ROOT / "pipelines" / "smoke.yaml"), *bad, *no_api),
        ("schedule", "create", "--name", "n", "--cron", "0 0 2 * * *", "--pipeline", "smoke", *bad, *no_api),
    ):
        line = _one_error_line(run("pipeline", *args))
        assert "unknown config key 'diloco.sync_evry'; did you mean 'diloco.sync_every'?" in line, args
        assert "KFP API" not in line
    assert not list(tmp_path.iterdir())
    good = ("--param", "overrides=[diloco.sync_every=8]", "--param", "learners=3")
    ok(run("pipeline", "compile", "--pipeline", "smoke", "--out", "s.yaml", *good))
    header = (tmp_path / "s.yaml").read_text().split("components:")[0]
    assert "learners: int [Default: 3.0]" in header and "'diloco.sync_every=8'" in header
