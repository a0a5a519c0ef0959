"""On real tiny runs: evaluate -> SFT -> evaluate, the numbers in summary.json, reports and the CLI."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re

import pytest

from ddiloco import keys
from ddiloco.cli.posttrain import register
from ddiloco.keys import EVAL_CURVE, REPORT_HTML, REPORT_MD, REPORT_METRICS, SFT_MODEL, eval_key
from ddiloco.posttrain.evaluate import build_tasks, evaluate_checkpoint, versions_after_round
from ddiloco.posttrain.summary import read_round_records
from tests.integration.conftest import TEST_EVAL

pytestmark = pytest.mark.slow


def cli(*argv: str) -> tuple[int, str]:
    parser = argparse.ArgumentParser(prog="ddiloco")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = args.func(args)
    return code, out.getvalue()


def test_sft_beats_the_pretrained_model_on_held_out_instructions(posttrained_runs):
    f = posttrained_runs.fields
    before, after = f["instruction_accuracy_before"], f["instruction_accuracy_after"]
    assert after["all"] > before["all"], (before, after)
    assert f["sft"]["heldout_response_loss_after"] < f["sft"]["heldout_response_loss_before"]
    assert set(f["task_accuracy"]) == set(f["sft_task_accuracy"]) == {
        "fact_mc", "fact_em", "arithmetic", "copy", "agreement", "count"
    }  # fmt: skip
    assert all(0.0 <= v <= 1.0 for v in [*f["task_accuracy"].values(), *f["sft_task_accuracy"].values()])
    # Replayed pre-training data keeps the fine-tuned model close to the pretrained one on the corpus.
    assert f["sft_val_loss"] < f["final_val_loss"] + 0.5


def test_results_are_in_summary_json_and_the_store(posttrained_runs):
    store = posttrained_runs.k1
    summary = store.get_json(keys.SUMMARY)
    for key in (
        "final_val_loss",
        "task_accuracy",
        "sft_val_loss",
        "sft_task_accuracy",
        "instruction_accuracy_after",
    ):
        assert summary[key] is not None, key
    assert summary["final_val_loss"] < summary["initial_val_loss"]
    for key in (eval_key("final"), eval_key("sft"), SFT_MODEL, "sft/meta.json", EVAL_CURVE):
        assert store.exists(key), key


def test_evaluation_is_deterministic(posttrained_runs):
    store = posttrained_runs.k1
    again = evaluate_checkpoint(posttrained_runs.roots["k1"], "final", name="final-again", ecfg=TEST_EVAL)
    first = store.get_json(eval_key("final"))
    assert again["val_loss"] == first["val_loss"]
    assert again["task_accuracy"] == first["task_accuracy"]


def test_global_loss_curve_falls_with_merged_tokens(posttrained_runs):
    points = posttrained_runs.k1.get_json(EVAL_CURVE)["points"]
    assert len(points) == TEST_EVAL.curve_points
    assert points[0]["tokens_merged"] == 0 and points[0]["versions"] == [0, 0]
    tokens = [p["tokens_merged"] for p in points]
    assert tokens == sorted(tokens) and tokens[-1] >= 150000
    assert points[-1]["val_loss"] < points[0]["val_loss"] - 1.0


def test_run_report_has_every_section_and_kfp_metrics(posttrained_runs):
    rep = posttrained_runs.report
    for heading in ("Summary", "Evaluation", "Loss", "Merged tokens and chaos events", "Learner incarnations",
                    "Rounds: quorum and grace", "Staleness", "Traffic", "Supervised fine-tuning"):  # fmt: skip
        assert f"<h2>{heading}</h2>" in rep["html"], heading
    assert len(re.findall(r'src="data:image/png;base64,[A-Za-z0-9+/=]{1000,}"', rep["html"])) >= 8
    assert "http://" not in rep["html"] and "https://" not in rep["html"], "the page must be self-contained"
    assert "## Evaluation" in rep["markdown"] and "| fact_mc |" in rep["markdown"]
    m = rep["metrics"]
    assert all(isinstance(v, float) for v in m.values())
    assert {
        "final_val_loss",
        "sft_val_loss",
        "goodput",
        "task_accuracy_fact_mc",
        "instruction_accuracy_after_all",
    } <= set(m)
    store = posttrained_runs.k1
    assert store.get(REPORT_HTML).decode() == rep["html"] and store.exists(REPORT_MD)
    assert store.get_json(REPORT_METRICS) == m


def test_report_cli_compares_two_runs(posttrained_runs, tmp_path):
    root = posttrained_runs.root
    code, out = cli(
        "report", str(root / "k1"), f"file://{root / 'km'}", "--out", str(tmp_path), "--curve-points", "3"
    )
    assert code == 0
    paths = json.loads(out)
    page = open(paths["html"]).read()
    assert "<h1>ddiloco comparison — 2 runs</h1>" in page
    assert "k1 (M=2, K=1)" in page and "km (M=2, K=2)" in page
    assert page.count("data:image/png;base64,") >= 5
    md = open(paths["markdown"]).read()
    assert "| k1 (M=2, K=1) | km (M=2, K=2) |" in md
    assert set(json.load(open(paths["metrics"]))) == {"k1 (M=2, K=1)", "km (M=2, K=2)"}


def _kept_round(store) -> int:
    """The first round after which every fragment has moved and whose versions retention still keeps (the
    run keeps the newest versions and the loss curve's moments, `ddiloco.config.retention`)."""
    records = read_round_records(store)
    kept = keys.global_versions_listed(store.list("global/"), 2)
    for r in sorted(records, key=lambda r: r["round"]):
        versions = versions_after_round(records, r["round"], 2)
        if 0 not in versions and all(v in kept[p] for p, v in enumerate(versions)):
            return r["round"]
    raise AssertionError("retention kept no model after a merge of every fragment")


def test_evaluate_cli_on_other_checkpoints(posttrained_runs):
    store = posttrained_runs.km
    n = _kept_round(store)
    code, out = cli(
        "evaluate", "--store", store.url, "--model", f"round:{n}", "--items", "4", "--tasks", "fact_mc,count"
    )
    assert code == 0
    result = json.loads(out)
    assert set(result["task_accuracy"]) == {"fact_mc", "count"} and result["model"] == f"round:{n}"
    assert store.get_json(eval_key(f"round-{n}"))["versions"] != [0, 0]
    code, out = cli("evaluate", "--store", store.url, "--model", "latest", "--items", "4", "--name", "now")
    assert code == 0 and store.exists(eval_key("now"))


def test_sft_cli_on_user_jsonl_then_evaluate_it(posttrained_runs, tmp_path):
    data = tmp_path / "pairs.jsonl"
    rows = [{"prompt": f"name the number {i}:", "response": f" {i}"} for i in range(40)]
    data.write_text("\n".join(json.dumps(r) for r in rows))
    store = posttrained_runs.km
    code, out = cli("sft", "--store", store.url, "--data", str(data), "--steps", "5", "--base", "latest")
    assert code == 0
    metrics = json.loads(out)
    assert metrics["data"] == str(data) and set(metrics["instruction_accuracy_after"]) == {
        "instructions",
        "all",
    }
    assert metrics["train_items"] + metrics["heldout_items"]["instructions"] == 40
    code, out = cli("evaluate", "--store", store.url, "--model", "sft", "--items", "4")
    assert code == 0 and json.loads(out)["model"] == "sft"


def test_user_corpus_runs_get_cloze_tasks_from_held_out_text(posttrained_runs):
    root = posttrained_runs.roots["km"]
    cfg = root.config()
    cfg.data.source = "my-corpus.txt"  # as if the run had trained on a user corpus
    tasks = build_tasks(root, cfg, root.tokenizer(), root.val(), TEST_EVAL)
    assert list(tasks) == ["cloze"] and len(tasks["cloze"]) == TEST_EVAL.items_per_task
    assert all(it.answer in it.choices and len(it.choices) == 4 for it in tasks["cloze"])


def test_posttrain_without_sft_only_evaluates(posttrained_runs):
    from ddiloco.posttrain.stages import posttrain

    fields = posttrain(posttrained_runs.roots["km"], eval_cfg=TEST_EVAL, skip_sft=True)
    assert fields["final_val_loss"] is not None and set(fields["task_accuracy"]) >= {"fact_mc", "count"}
    assert fields["sft_val_loss"] is None and fields["instruction_accuracy_after"] is None
