"""`ddiloco evaluate` and `ddiloco sft` run with the `eval:` / `sft:` sections of the config the run was prepared
with, `--set eval.x=y` / `--set sft.x=y` change them, an explicit flag wins over both, and `--set` of another
section is refused."""

from __future__ import annotations

import pytest

from ddiloco import keys
from ddiloco.cli.main import main
from ddiloco.run.prepare import prepare
from ddiloco.store.url import open_store
from tests._harness import tiny_config

RUN_SECTIONS = (
    "eval.items_per_task=3",
    "eval.tasks=[arithmetic, copy]",
    "sft.base=latest",  # no final model in a run that was only prepared
    "sft.steps=2",
    "sft.batch_size=4",
    "sft.lr=0.002",
    "sft.items_per_kind=10",
    "sft.eval_items=4",
)


@pytest.fixture(scope="module")
def run_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    url = f"file://{tmp_path_factory.mktemp('posttrain-cli')}/pt"
    prepare(open_store(url), tiny_config("pt", *RUN_SECTIONS))
    return url


@pytest.fixture(autouse=True)
def unsigned(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DDILOCO_RUN_KEY", raising=False)


def evaluate(url: str, name: str, *extra: str) -> dict[str, dict]:
    assert main(["evaluate", "--store", url, "--model", "latest", "--name", name, *extra]) == 0
    return open_store(url).get_json(keys.eval_key(name))["tasks"]


def sft_config(url: str, *extra: str) -> dict:
    assert main(["sft", "--store", url, *extra]) == 0
    return open_store(url).get_json(keys.SFT_META)["config"]


def test_evaluate_reads_the_runs_eval_section(run_url):
    tasks = evaluate(run_url, "from-config")
    assert set(tasks) == {"arithmetic", "copy"}
    assert {t["n"] for t in tasks.values()} == {3}


def test_evaluate_set_overrides_the_section_and_flags_win(run_url):
    tasks = evaluate(run_url, "set", "--set", "eval.tasks=[count]", "--set", "eval.items_per_task=2")
    assert set(tasks) == {"count"} and tasks["count"]["n"] == 2
    tasks = evaluate(run_url, "flag", "--set", "eval.items_per_task=2", "--items", "4")
    assert set(tasks) == {"arithmetic", "copy"} and {t["n"] for t in tasks.values()} == {4}


def test_sft_reads_the_runs_sft_section(run_url):
    cfg = sft_config(run_url)
    assert (cfg["base"], cfg["steps"], cfg["batch_size"], cfg["lr"]) == ("latest", 2, 4, 0.002)
    assert (cfg["items_per_kind"], cfg["eval_items"]) == (10, 4)


def test_sft_set_overrides_the_section_and_flags_win(run_url):
    cfg = sft_config(run_url, "--set", "sft.steps=1", "--set", "sft.lr=0.005", "--lr", "0.003")
    assert (cfg["steps"], cfg["lr"], cfg["batch_size"]) == (1, 0.003, 4)


@pytest.mark.parametrize(
    ("command", "override"),
    [("evaluate", "diloco.quorum=2"), ("evaluate", "sft.steps=3"), ("sft", "eval.items_per_task=3")],
)
def test_set_of_another_section_is_one_error_line(run_url, capsys, command, override):
    assert main([command, "--store", run_url, "--set", override]) == 2
    err = capsys.readouterr().err
    assert f"only {command.replace('evaluate', 'eval')}.KEY=VALUE applies" in err
    assert "fixed when it was prepared" in err
