"""`ddiloco evaluate --harness lm-eval`: a trained run's final model scored by lm-evaluation-harness (the
pinned library, no network) on this package's own tasks as lm-eval task YAMLs and on a user's task
directory; both evaluators agree on the same items; the results land in eval/ and in the report, whose
table headless Chromium renders; the pipeline's evaluate step runs a team's task YAMLs and a datasets cache
from store prefixes, offline."""

import contextlib
import io
import json
import re
from pathlib import Path

import pytest

from ddiloco.cli.main import main
from ddiloco.run.prepare import prepare
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


def test_the_builtin_harness_refuses_a_task_directory(trained, tmp_path, capsys):
    """A directory of lm-eval task YAMLs is for `--harness lm-eval` (run in the test below)."""
    url, _ = trained
    (tmp_path / "mine.yaml").write_text("task: my_copy\n")
    assert main(["evaluate", "--store", url, "--tasks", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "add --harness lm-eval" in err


def _hub_dataset_cache(cache: Path, repo: str, rows: list[dict]) -> None:
    """What `datasets.load_dataset(repo)` leaves in HF_DATASETS_CACHE on a machine with internet:
    `<org>___<name>/default/0.0.0/<hash>/<name>-test.arrow` + dataset_info.json (the layout the `cache`
    builder reads offline: datasets/packaged_modules/cache/cache.py _find_hash_in_cache), built from local
    rows with the json builder, then named as the Hub dataset's."""
    from datasets.packaged_modules.json.json import Json

    org, name = repo.split("/")
    data = cache.parent / f"{name}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    Json(
        cache_dir=str(cache), dataset_name=f"{org}___{name}", data_files={"test": str(data)}, hash="0"
    ).download_and_prepare()
    built = next((cache / f"{org}___{name}").glob("default-*"))
    snapshot = built.rename(built.with_name("default")) / "0.0.0" / "0"
    info = json.loads((snapshot / "dataset_info.json").read_text())
    (snapshot / "dataset_info.json").write_text(
        json.dumps({**info, "config_name": "default", "dataset_name": name})
    )
    (snapshot / f"{org}___{name}-test.arrow").rename(snapshot / f"{name}-test.arrow")


def test_the_evaluate_step_runs_task_yamls_and_a_datasets_cache_from_store_prefixes_offline(
    trained, tmp_path
):
    """The pipeline's `lm_eval_tasks` / `lm_eval_datasets`: a store prefix of task folders (one reading its
    data by a path relative to the prefix, one naming a Hub dataset) and a prefix holding a datasets cache;
    the evaluate step copies both and lm-eval runs every task offline."""
    from ddiloco.components.evaluation import evaluate

    url, store = trained
    rows = [
        {"q": f"copy: {w} ->", "choices": [f" {w}", " zzzz"], "gold": 0} for w in ("alpha", "omega", "delta")
    ]
    spec = (
        "dataset_path: {path}\n{kwargs}test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{{{q}}}}'\n"
        "doc_to_choice: '{{{{choices}}}}'\ndoc_to_target: '{{{{gold}}}}'\ntarget_delimiter: ''\n"
        "metric_list:\n  - metric: acc\n"
    )
    tasks = open_store((tmp_path / "store" / "lm-eval" / "tasks").as_uri())
    tasks.put("local/data/test.jsonl", "".join(json.dumps(r) + "\n" for r in rows).encode())
    local = spec.format(
        path="json", kwargs="dataset_kwargs:\n  data_files:\n    test: local/data/test.jsonl\n"
    )
    tasks.put("local/local.yaml", f"task: local_copy\n{local}".encode())
    tasks.put(
        "hub/hub.yaml", f"task: hub_copy\n{spec.format(path='ddiloco-test/copy_words', kwargs='')}".encode()
    )
    (tmp_path / "built").mkdir()
    _hub_dataset_cache(tmp_path / "built" / "datasets", "ddiloco-test/copy_words", rows[:2])
    cache = open_store((tmp_path / "store" / "lm-eval" / "datasets").as_uri())
    for path in (tmp_path / "built" / "datasets").rglob("*"):
        if path.is_file():
            cache.put(str(path.relative_to(tmp_path / "built" / "datasets")), path.read_bytes())

    class Metrics:
        metadata: dict = {}

        def log_metric(self, name: str, value: float) -> None:
            self.metadata[name] = value

    metrics = Metrics()
    evaluate(metrics, url, "final", lm_eval_tasks=tasks.url, lm_eval_datasets=cache.url)
    assert 0 < metrics.metadata["val_loss"] < 10  # the built-in evaluation first
    assert (
        0 <= metrics.metadata["lm_eval.local_copy.acc"] <= 1
        and 0 <= metrics.metadata["lm_eval.hub_copy.acc"] <= 1
    )
    written = store.get_json("eval/lm-final-tasks.json")
    assert written["n-samples"]["local_copy"]["effective"] == 3
    assert written["n-samples"]["hub_copy"]["effective"] == 2  # the cached Hub dataset's rows
