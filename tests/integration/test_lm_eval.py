"""`ddiloco evaluate --harness lm-eval`: a trained run's final model scored by lm-evaluation-harness (the
pinned library, no network) on this package's own tasks as lm-eval task YAMLs and on a user's task
directory; both evaluators agree on the same items; the results land in eval/ and in the report, whose
table headless Chromium renders."""

import contextlib
import io
import json
import re
from pathlib import Path

import pytest

from ddiloco.cli.main import main
from ddiloco.prepare import prepare
from ddiloco.store.url import open_store
from tests._harness import tiny_config, train_in_process
from tests.integration.test_report_browser import CHROMIUM, chromium

pytest.importorskip("lm_eval")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    url = f"file://{tmp_path_factory.mktemp('lm-eval')}/run"
    store = open_store(url)
    cfg = tiny_config("lm-eval", "diloco.token_budget=24000")
    prepare(store, cfg)
    train_in_process(store, 2)
    return url, store


def _cli(*args: str) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(list(args)) == 0
    return json.loads(out.getvalue().strip().splitlines()[-1])


def test_lm_eval_agrees_with_the_builtin_evaluator_on_the_same_items_and_its_table_renders(trained, tmp_path):
    url, store = trained
    ours = _cli("evaluate", "--store", url, "--items", "30")["task_accuracy"]
    printed = _cli("evaluate", "--store", url, "--items", "30", "--harness", "lm-eval")
    written = store.get_json("eval/lm-final.json")
    assert written["harness"] == "lm-eval" and written["lm_eval_version"] == "0.4.13"
    assert {"results", "versions", "n-samples", "configs"} <= set(written)
    lm = printed["lm_eval"]
    assert set(lm) == {f"ddiloco_{t}" for t in ours}
    for task, acc in ours.items():
        row = lm[f"ddiloco_{task}"]
        metric = "acc" if "acc" in row else "exact_match"
        assert abs(row[metric] - acc) <= row[f"{metric}_stderr"] + 1e-9, (task, acc, row)
        assert written["n-samples"][f"ddiloco_{task}"]["effective"] == 30
    assert any(v > 0 for v in ours.values()), "a trained model gets some items right"

    paths = _cli("report", url, "--out", url.removeprefix("file://") + "-report")
    text = open(paths["markdown"]).read()
    assert "## lm-evaluation-harness" in text and "| final | ddiloco_fact_mc | acc |" in text
    if CHROMIUM is None:
        pytest.skip("Debian `chromium` is not installed: the page was checked as text only; CI installs it")
    # The page as a person sees it: headless Chromium's DOM holds the table, a row per task with its stderr.
    out = chromium(tmp_path, "--virtual-time-budget=5000", "--dump-dom", Path(paths["html"]).as_uri())
    assert out.returncode == 0, out.stderr[-2000:]
    section = out.stdout.split("<h2>lm-evaluation-harness</h2>", 1)[1].split("<h2>", 1)[0]
    rows = re.findall(r"<tr>(.*?)</tr>", section, flags=re.S)
    cells = [re.findall(r"<t[dh][^>]*>(.*?)</t[dh]>", r) for r in rows]
    assert cells[0] == ["checkpoint", "task", "metric", "value", "stderr", "items"], cells[0]
    by_task = {c[1]: c for c in cells[1:]}
    assert set(by_task) == {f"ddiloco_{t}" for t in ours}
    for name, row in by_task.items():
        want = lm[name]
        assert row[0] == "final" and row[5] == "30", row
        assert abs(float(row[3]) - want[row[2]]) < 1e-3, row
        assert abs(float(row[4]) - want[f"{row[2]}_stderr"]) < 1e-3, row  # the stderr column


def test_a_user_task_directory_runs_and_the_builtin_harness_refuses_it(trained, tmp_path, capsys):
    url, store = trained
    data = tmp_path / "pairs.jsonl"
    rows = [
        {"q": f"copy: {w} ->", "choices": [f" {w}", " zzzz"], "gold": 0} for w in ("alpha", "omega", "delta")
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "mine.yaml").write_text(
        f"task: my_copy\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{q}}'\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{gold}}'\ntarget_delimiter: ''\nmetric_list:\n  - metric: acc\n"
    )
    got = _cli("evaluate", "--store", url, "--harness", "lm-eval", "--tasks", str(tmp_path), "--name", "mine")
    assert set(got["lm_eval"]) == {"my_copy"} and 0 <= got["lm_eval"]["my_copy"]["acc"] <= 1
    assert store.get_json("eval/lm-mine.json")["n-samples"]["my_copy"]["effective"] == 3
    capsys.readouterr()
    assert main(["evaluate", "--store", url, "--tasks", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "add --harness lm-eval" in err
