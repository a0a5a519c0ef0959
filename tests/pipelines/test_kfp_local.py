"""Every component under `kfp.local` (SubprocessRunner, this interpreter) on the tiny recipe, `file://` store.

Order: prepare → learners ∥ syncer → chaos → evaluate(final) → sft → evaluate(sft) → report; export(final)
after them. The learners
and the syncer run *at the same time*, each as its own kfp.local task on a thread, as the pipeline runs
them: learners never block, but the syncer only opens rounds while learners are alive and only learners
answer rounds, so no sequential order of the two can reach the token budget (a learner started after the
syncer stopped, or before it started, trains alone and is never merged).
"""

from __future__ import annotations

import json
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from pathlib import Path

import pytest
from ddiloco.components.roles import build

pytestmark = [
    pytest.mark.slow,
    # kfp.local warns about a "non-Python base image": ours hold Python and ddiloco, and this interpreter has both
    pytest.mark.filterwarnings("ignore:You may be attemping:RuntimeWarning"),
]

ROOT = Path(__file__).resolve().parents[2]
TINY = [
    "model.n_layer=1", "model.n_head=2", "model.n_embd=32", "model.seq_len=32", "train.batch_size=4",
    "data.synthetic_docs=600", "data.synthetic_entities=8", "diloco.fragments=2", "eval.val_batches=2",
    "train.checkpoint_every_s=5",
    # evaluation and SFT at the harness's tiny sizes (tests._harness.TINY), not the defaults' 200 items per
    # task and 300 SFT steps: the steps' outputs are checked, not their quality
    "eval.items_per_task=8", "eval.curve_points=3", "sft.steps=20", "sft.items_per_kind=40", "sft.eval_items=16",
]  # fmt: skip


def stop_learners(store: str) -> None:
    """What the syncer publishes when a run is over; learners exit at their next step."""
    from ddiloco import keys
    from ddiloco.store.url import open_store
    from tests._harness import status

    open_store(store).put_json(keys.STATUS, status(done=True).to_json())


@pytest.fixture(scope="module")
def comps(tmp_path_factory):
    """The components under kfp.local, in this interpreter."""
    from kfp import local

    mp = pytest.MonkeyPatch()
    mp.setenv("PYTHONPATH", str(ROOT))  # the component bodies import `ddiloco.components.runtime`
    root = tmp_path_factory.mktemp("kfp-root")
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(root), raise_on_error=True)
    yield build()
    mp.undo()


@pytest.fixture(scope="module")
def trained(comps, tmp_path_factory):
    """prepare, then two learners and the syncer at once: (run root URL, {step: task}). Every step gets the
    store base and the run id, as in the pipeline, and works in `{base}/{run_id}`."""
    c = comps
    base = f"file://{tmp_path_factory.mktemp('kfp-local')}"
    run = {"store": base, "run_id": "kfp-local"}
    tasks = {"prepare": c.prepare(**run, recipe="tiny-cpu", overrides=TINY, learners=2, token_budget=12000)}
    store = f"{base}/kfp-local"
    ids = [int(i) for i in tasks["prepare"].output]  # kfp.local returns JSON numbers as floats
    with ThreadPoolExecutor(len(ids) + 1) as pool:
        syncer = pool.submit(c.syncer, **run, max_seconds=400.0)
        learners = [pool.submit(c.learner, **run, learner_id=i) for i in ids]
        done, _ = wait([syncer, *learners], timeout=600, return_when=FIRST_EXCEPTION)
        failed = [f for f in done if f.exception() is not None]
        if failed:
            stop_learners(store)  # the syncer will not say "done": tell the learners, then fail
            failed[0].result()
        tasks["syncer"] = syncer.result(timeout=600)
        tasks["learners"] = [f.result(timeout=600) for f in learners]
    return store, tasks


@pytest.fixture(scope="module")
def post_trained(comps, trained):
    """evaluate(final) → sft → evaluate(sft) → report, as the pipeline chains them."""
    c, (store, tasks) = comps, trained
    tasks["evaluate-final"] = c.evaluate(store=store, model="final", lm_eval=True)
    tasks["sft"] = c.sft(store=store)
    tasks["evaluate-sft"] = c.evaluate(store=store, model="sft")
    tasks["report"] = c.report(store=store)
    return store, tasks


def test_prepare_learners_and_syncer_finish_the_run(trained):
    store, tasks = trained
    root = Path(store.removeprefix("file://"))
    assert [int(i) for i in tasks["prepare"].output] == [0, 1]
    assert (root / "done.json").is_file()
    config = json.loads((root / "config.json").read_text())
    assert config["run_id"] == "kfp-local" and config["diloco"]["learners"] == 2
    assert config["diloco"]["token_budget"] == 12000 and config["model"]["n_embd"] == 32
    assert (root / "final" / "model.safetensors").is_file()


def test_chaos_records_what_it_did(comps, trained):
    store, _ = trained
    events = comps.chaos(store=store, backend="local").outputs["events"]
    assert "nothing fired" in Path(events.path).read_text()  # the run had no chaos schedule


def test_evaluate_logs_metrics(post_trained):
    _, tasks = post_trained
    for step in ("evaluate-final", "evaluate-sft"):
        metrics = tasks[step].outputs["metrics"].metadata
        assert 0 < metrics["val_loss"] < 10 and metrics["perplexity"] > 1, (step, metrics)
    lm = tasks["evaluate-final"].outputs["metrics"].metadata  # lm_eval=True: lm-evaluation-harness too
    assert 0 <= lm["lm_eval.ddiloco_fact_mc.acc"] <= 1 and "lm_eval.ddiloco_fact_mc.acc_stderr" in lm


def test_sft_and_report_write_their_artifacts(post_trained):
    _, tasks = post_trained
    assert tasks["sft"].outputs["metrics"].metadata, "sft logs its metrics"
    report = tasks["report"].outputs
    assert "<html" in Path(report["html"].path).read_text().lower()
    assert Path(report["markdown"].path).read_text().strip()
    assert report["summary"].metadata["tokens_merged"] >= 12000


def test_the_final_model_is_a_hugging_face_directory_with_a_model_card(comps, post_trained):
    """The pipeline's `export-final` step (after the evaluation): transformers loads the Model artifact's
    directory alone, with the run's logits; the metadata is the model card. (`export-sft` is the same code
    on `sft`: the twin's pretrain run checks its artifact, test_posttrain_user_corpus a skipped SFT's.)"""
    import torch
    from transformers import AutoModelForCausalLM

    from ddiloco.posttrain.evaluate import load_model
    from ddiloco.run.root import RunRoot
    from ddiloco.store.url import open_store

    store, tasks = post_trained
    art = comps.export_final(store=store).outputs["final_model"]
    card = art.metadata
    assert card["format"] == "huggingface" and card["checkpoint"] == "final" and card["present"]
    assert card["architecture"] == "GPT2LMHeadModel" and "model.safetensors" in card["files"]
    assert card["tokens_trained"] >= 12000 and card["run_root"] == store
    assert card["val_loss"] == tasks["evaluate-final"].outputs["metrics"].metadata["val_loss"]
    hf = AutoModelForCausalLM.from_pretrained(art.path).eval()
    assert card["parameters"] == sum(p.numel() for p in hf.parameters())
    root = RunRoot(open_store(store), "kfp-local")
    ours, _ = load_model(root, "final", root.layout())
    x = root.val()[:32].long()[None]
    with torch.no_grad():
        assert (hf(input_ids=x).logits - ours.eval()(x)[0]).abs().max().item() <= 1e-5
