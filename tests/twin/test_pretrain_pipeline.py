"""The compiled `pretrain` pipeline end to end through the twin: tokenize (a text corpus in the store) →
prepare → 2 learners ∥ syncer ∥ chaos → evaluate → SFT → evaluate → report, on a real S3 server (SeaweedFS on loopback), with two chaos
kills landing after the 5-minute mark of cluster time (time_scale 60: 300 s of Argo time is 5 s here).

What must hold on a real KFP 2.17 cluster, and fails with the YAML ddiloco 0.1.0 compiled (the db5ec2f
fixture): the run root resolves (the run id is a whole-value placeholder), the kills find their pods (the
keepers' worker pods; with `--no-keeper` the task pods, by the downward-API pod name, not the 63-character
hostname), the killed learners come back with their learner id (a keeper's next worker; with `--no-keeper`
Argo's retry, whose maxDuration covers the run: the old 300 s refused any retry after 5 minutes), and the
report exists. The broken YAML fails at its first step; `test_chaos_and_fixture.py` shows how.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import yaml
from ddiloco.pipelines.compile import compile_pipeline

from ddiloco.protocol.signing import learner_env
from ddiloco.store.url import open_store
from tests.twin import KFP_2_17, Cluster, Twin, stragglers

pytestmark = [pytest.mark.twin, pytest.mark.s3, pytest.mark.slow, pytest.mark.timeout(1200)]

EXTRA_ENV = {"PYTHONPATH": os.environ["TWIN_PYTHONPATH"]} if os.environ.get("TWIN_PYTHONPATH") else {}
"""TWIN_PYTHONPATH=DIR: the pods import ddiloco from DIR (a second checkout) instead of the installed one."""
FIXTURE = Path(__file__).parent / "fixtures" / "pretrain-db5ec2f.yaml"
TIME_SCALE = 60.0
OLD_MAX_DURATION_S = 300.0  # the db5ec2f YAML's backoffMaxDuration
NAMESPACE = "team-a"  # a profile namespace: the default prefix must be one its identity may write
TINY = [
    "model.n_layer=1", "model.n_head=2", "model.n_embd=32", "model.seq_len=32", "train.batch_size=4",
    "data.synthetic_docs=600", "data.synthetic_entities=8", "diloco.fragments=2", "eval.val_batches=2",
    "train.checkpoint_every_s=1", "train.threads=1", "sft.steps=20",
]  # fmt: skip
MASTER_KEY = "5c" * 32
RUN_KEY_SECRETS = {  # keys per role: the master key for prepare, syncer and post-training, a share for learners
    "ddiloco-run-key": {"key": MASTER_KEY},
    "ddiloco-learner-key": {
        "learner": learner_env(bytes.fromhex(MASTER_KEY))["DDILOCO_LEARNER_KEY"],
        "syncer_pub": learner_env(bytes.fromhex(MASTER_KEY))["DDILOCO_SYNCER_PUBKEY"],
    },
}
KILLS_AT_S = (8.0, 12.0)  # real seconds after prepare: 480 s and 720 s of cluster time, past 300 s


def twin_and_args(yaml_path: Path, s3, work: Path, token_budget: int) -> tuple[Twin, dict]:
    chaos = {"events": [{"kind": "kill_learner", "learner": i, "at_s": t} for i, t in enumerate(KILLS_AT_S)]}
    cluster = Cluster(
        namespace=NAMESPACE,
        secrets={
            "mlpipeline-minio-artifact": {"accesskey": s3.access_key, "secretkey": s3.secret_key},
            **RUN_KEY_SECRETS,
        },
    )
    twin = Twin(
        yaml_path, work, cluster=cluster, workflow_defaults=KFP_2_17, time_scale=TIME_SCALE, timeout_s=420,
        env={"OMP_NUM_THREADS": "1", **EXTRA_ENV},
    )  # fmt: skip
    args = {
        "recipe": "tiny-cpu", "overrides": TINY, "learners": 2, "token_budget": token_budget,
        "chaos": json.dumps(chaos), "store_bucket": s3.bucket, "s3_endpoint": s3.endpoint.split("://")[-1],
    }  # fmt: skip
    return twin, args


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> Path:
    return compile_pipeline("pretrain", tmp_path_factory.mktemp("twin-compiled") / "pretrain.yaml")


@pytest.fixture(scope="module")
def direct(tmp_path_factory) -> Path:
    """`--no-keeper`: learners and the syncer in their task pods, whose retries Argo decides."""
    return compile_pipeline(
        "pretrain", tmp_path_factory.mktemp("twin-direct") / "pretrain.yaml", keeper=False
    )


@pytest.fixture(scope="module")
def pretrain_run(profile_s3, compiled, tmp_path_factory):
    """The run with namespace team-a's own store key (tests/_kfp_profile.py: the user and bucket policy KFP
    2.17's profile controller writes), not the server's admin key."""
    assert profile_s3.namespace == NAMESPACE
    work = tmp_path_factory.mktemp("twin-pretrain")
    # Enough tokens that training outlasts the second kill (12 s) by the new incarnation's first report on a
    # quiet machine: with 150k the run was over before learner 1's second incarnation reported.
    twin, args = twin_and_args(compiled, profile_s3, work, 300_000)
    twin.timeout_s = 900  # the whole pipeline, report included, on a loaded 2-core runner
    args["text_corpus"] = _text_corpus(profile_s3)  # the tokenize step turns it into .npy parts in the store
    pairs = work / "instructions.jsonl"  # sft.data: a user corpus brings its own instructions
    pairs.write_text("".join(json.dumps({"prompt": f"copy {w}:", "response": f" {w}"}) + "\n" for w in WORDS))
    args["overrides"] = [*TINY, "data.chunk_tokens=4096", f"sft.data={pairs}"]
    return twin.run(args), profile_s3


WORDS = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta", "zeta", "lambda"] * 4


def _text_corpus(s3) -> str:
    """The synthetic corpus as text in the namespace's own prefix (what a team uploads), for `text_corpus`."""
    from ddiloco.data.synthetic import make_world, synthetic_documents

    texts = open_store(s3.url(f"private/{NAMESPACE}/texts"), env=s3.env())
    docs = synthetic_documents(make_world(0, 8), 0, 1500)
    for i in range(2):
        texts.put(f"docs-{i}.jsonl", "".join(json.dumps({"text": d}) + "\n" for d in docs[i::2]).encode())
    return texts.url


def test_the_pipeline_runs_end_to_end_under_the_profile_identity(pretrain_run):
    run, s3 = pretrain_run
    assert run.phase == "Succeeded", run.explain()
    for name in (
        "tokenize-plan",
        "tokenize-finish",
        "prepare",
        "syncer",
        "chaos",
        "evaluate",
        "export-final",
        "sft",
        "evaluate-2",
        "export-sft",
        "report",
    ):  # task keys
        assert run.task(name).phase == "Succeeded", (name, run.explain())
    root = f"s3://{s3.bucket}/private/{NAMESPACE}/ddiloco/{run.run_id}"
    store = open_store(root, env=s3.env())
    assert store.get_json("config.json")["run_id"] == run.run_id
    # The text was tokenized by the tokenize step into the store and read in place: no shard in the run root.
    units = run.find("tokenize-unit")  # the ParallelFor: one pod per input file
    assert len(units) == 2 and all(u.phase == "Succeeded" for u in units), run.explain()
    corpus = run.task("tokenize-finish").outputs["Output"]
    assert corpus.startswith(f"s3://{s3.bucket}/private/{NAMESPACE}/ddiloco/corpora/corpus-"), corpus
    assert store.get_json("data/corpus.json")["source"] == corpus and not store.list("data/shards")
    assert (
        store.exists("done.json")
        and store.exists("final/model.safetensors")
        and store.exists("sft/meta.json")
    )
    assert stragglers(run.run_id) == []
    # Keys per role: the syncer signed what learners act on with its own key, the learners' answers (signed
    # with their share) were all accepted.
    from ddiloco.protocol import signing

    keys_ = signing.for_run(bytes.fromhex(MASTER_KEY), run.run_id)
    for doc in ("done.json", "syncer/status.json"):
        assert signing.check_doc(store.get_json(doc), keys_, signing.SYNCER) is None, doc
    state = store.get_json("syncer/state.json")
    # Nothing rejected: not a signature, and not a merged answer the cleaner had not deleted yet (counted as a
    # `replay` once, with xdist's other worker busy: tests/unit/test_late_sweep.py).
    assert sum(state["ledger"][0].values()) > 0 and not any(state["rejected"].values()), state["rejected"]


def test_final_model_is_a_model_artifact_whose_uri_is_a_directory_transformers_loads(pretrain_run, tmp_path):
    """What the KFP UI lists for the run (the launcher's MLMD record: tests/twin/launcher.py collect_outputs):
    `final_model` of type system.Model, its URI a Hugging Face directory (a local path in the twin, where
    KFP's is minio://... in the pipeline root), its metadata the model card; `sft_model` alike."""
    import shutil

    from transformers import AutoModelForCausalLM

    run, s3 = pretrain_run
    final = run.task("export-final").artifacts["final_model"]
    assert final["type"]["schemaTitle"] == "system.Model", final
    card = final["metadata"]
    assert card["architecture"] == "GPT2LMHeadModel" and card["format"] == "huggingface", card
    assert card["tokens_trained"] >= 300_000 and 0 < card["val_loss"] < 10 and card["parameters"] > 0, card
    assert card["run_root"] == f"s3://{s3.bucket}/private/{NAMESPACE}/ddiloco/{run.run_id}"
    local = shutil.copytree(final["uri"], tmp_path / "final_model")  # what a download of the URI gives
    lm = AutoModelForCausalLM.from_pretrained(local)
    assert type(lm).__name__ == card["architecture"]
    assert sum(p.numel() for p in lm.parameters()) == card["parameters"]
    tuned = run.task("export-sft").artifacts["sft_model"]
    assert tuned["type"]["schemaTitle"] == "system.Model" and tuned["metadata"]["present"], tuned
    assert (Path(tuned["uri"]) / "config.json").is_file() and tuned["metadata"]["sft_steps"] == 20


def test_kills_find_the_learners_worker_pods_and_their_keepers_bring_them_back_with_the_same_learner_id(
    pretrain_run,
):
    """The chaos step selects learner pods by role label: with keepers, the workers. Each killed worker's
    keeper sees its pod gone and starts the next incarnation of the same learner; the keeper task itself
    never fails."""
    from ddiloco.components.keeper import Slot

    run, s3 = pretrain_run
    learners = sorted(
        run.find("learner"), key=lambda t: t.executor_input["inputs"]["parameterValues"]["learner_id"]
    )
    assert len(learners) == 2
    for lid, task in enumerate(learners):
        assert [a.phase for a in task.attempts] == ["Succeeded"], run.explain()
        assert task.executor_input["inputs"]["parameterValues"]["learner_id"] == lid
        assert "started worker " + Slot("learner", run.run_id, lid).name(1) in task.attempts[0].tail(400)
    root = f"s3://{s3.bucket}/private/{NAMESPACE}/ddiloco/{run.run_id}"
    store = open_store(root, env=s3.env())
    for lid in range(len(learners)):
        incarnations = {
            k.split("/")[2] for k in store.list(f"learners/{lid:03d}/") if k.endswith("report.json")
        }
        assert len(incarnations) >= 2, (lid, incarnations)  # the new worker came back as learner lid
    fired = [store.get_json(k) for k in store.list("chaos/k8s/")]
    kills = [r for r in fired if r.get("kind") == "kill_learner"]
    assert len(kills) == 2 and all(r["action"] == "deleted pod" for r in kills), kills
    assert {r["pod"] for r in kills} == {Slot("learner", run.run_id, lid).name(0) for lid in range(2)}
    posted = [r["body"] for r in run.api_requests if r["method"] == "POST" and r["path"].endswith("/pods")]
    workers = [b for b in posted if b["metadata"]["labels"].get("ddiloco.io/role") == "learner"]
    assert len(workers) >= 4  # two learners, each killed once
    for body in workers:  # NCCL's /dev/shm, accepted by the API stand-in (a mount names its volume)
        assert body["spec"]["volumes"] == [
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "4Gi"}}
        ]
        assert body["spec"]["containers"][0]["volumeMounts"] == [{"name": "dshm", "mountPath": "/dev/shm"}]


def test_the_report_is_produced(pretrain_run):
    run, _ = pretrain_run
    report = run.task("report")
    html = Path(report.artifacts["html"]["uri"])
    assert "<html" in html.read_text().lower()
    assert Path(report.artifacts["markdown"]["uri"]).read_text().strip()


# --- each defect of the YAML ddiloco 0.1.0 compiled, put back alone: the same run fails ----------------------
def test_the_yaml_ddiloco_0_1_0_compiled_fails_at_its_first_step(s3_server, tmp_path):
    """The db5ec2f YAML: `store` embeds {{$.pipeline_job_uuid}}, which the driver resolves only as a whole
    value; prepare gets the literal and fails, and nothing else runs (KFP 2.17 does not retry it)."""
    twin, args = twin_and_args(FIXTURE, s3_server, tmp_path, 600_000)
    args["store_prefix"] = "ddiloco"  # its own default; it had no {namespace}
    run = twin.run(args)
    assert run.phase == "Failed"
    prep = run.task("prepare")
    assert prep.phase == "Failed" and "{{$.pipeline_job_uuid}}" in prep.attempts[0].log.read_text()
    assert all(t.phase == "Omitted" for t in run.find("learner") + run.find("syncer"))
    assert stragglers(run.run_id) == []


@pytest.mark.long  # a defect of the old YAML, on the --no-keeper path
def test_with_the_old_300s_max_duration_kills_after_five_minutes_are_not_retried(s3_server, direct, tmp_path):
    """Argo counts maxDuration from the first attempt's start (operator.go, processNodeRetries): the task
    pods of `--no-keeper` learners; the pod's retry node refuses the retry. Only the stock retryStrategy of
    the executor DAG above it (dagretry.py) runs the learner again, at most twice: a third late kill would
    lose it."""
    old = tmp_path / "pretrain-300s.yaml"
    old.write_text(direct.read_text().replace("backoffMaxDuration: 259200s", "backoffMaxDuration: 300s"))
    twin, args = twin_and_args(old, s3_server, tmp_path / "run", 600_000)
    with twin.start(args) as ex:
        run = ex.wait_until(
            lambda r: len(r.find("learner")) == 2 and all(len(t.attempts) == 2 for t in r.find("learner")),
            90,
        )
        for task in run.find("learner"):
            assert [a.message for a in task.attempts[:1]] == ["pod deleted"], run.explain()
            assert "Max duration limit exceeded" in task.reason, task.reason
            assert task.attempts[1].node_name.endswith(".learner(1).executor(0)"), task.attempts[1].node_name
    assert stragglers(run.run_id) == []


@pytest.mark.long  # a defect of the old YAML, on the --no-keeper path
def test_with_hostnames_instead_of_pod_names_the_kills_find_no_pod(s3_server, direct, tmp_path):
    """Every `--no-keeper` learner's hostname is the same 63-character prefix of its pod name, which names no
    pod (keepers give their workers short names)."""
    spec = list(yaml.safe_load_all(direct.read_text()))
    for ex in spec[1]["platforms"]["kubernetes"]["deploymentSpec"]["executors"].values():
        ex["fieldPathAsEnv"] = [e for e in ex.get("fieldPathAsEnv", []) if e["name"] != "DDILOCO_POD_NAME"]
    old = tmp_path / "pretrain-hostname.yaml"
    old.write_text(yaml.safe_dump_all(spec, sort_keys=False))
    twin, args = twin_and_args(old, s3_server, tmp_path / "run", 600_000)
    with twin.start(args) as ex:
        # both kills are due by 12 s after prepare; give the chaos step time to try them
        run = ex.wait_until(lambda r: r.task("chaos").attempts[0].started_real is not None, 90)
        time.sleep(KILLS_AT_S[-1] + 8)
        with ex.lock:
            learners = run.find("learner")
            assert len(learners) == 2 and all(len(t.attempts) == 1 for t in learners), run.explain()
            hosts = {t.attempts[0].hostname for t in learners}
            assert len(hosts) == 1, hosts  # both learners report the same truncated hostname
            assert not [r for r in run.api_requests if r["method"] == "DELETE"], "no pod was deletable"
    assert stragglers(run.run_id) == []


# --- the exit handler: failed and terminated runs get their report, and nothing is left running -----------
def test_a_run_started_from_the_ui_with_a_misspelt_override_fails_at_its_first_step_and_still_reports(
    s3_server, compiled, tmp_path
):
    """The KFP UI submits parameters no `ddiloco pipeline` command checked: the first step (tokenize-plan)
    checks them as prepare would and fails with the did-you-mean of `ddiloco pipeline submit` (a Failed pod,
    which KFP 2.17's OnError does not retry), before any data is read or any learner starts; the report says
    how far it got."""
    twin, args = twin_and_args(compiled, s3_server, tmp_path, 600_000)
    args["overrides"] = [*TINY, "diloco.sync_evry=8"]
    run = twin.run(args)
    assert run.phase == "Failed", run.explain()
    [attempt] = run.task("tokenize-plan").attempts
    assert attempt.phase == "Failed" and "did you mean 'diloco.sync_every'" in attempt.log.read_text()
    assert attempt.finished_real - attempt.started_real < 60, "seconds, not minutes"
    assert {t.phase for t in run.find("prepare") + run.find("learner") + run.find("syncer")} <= {"Omitted"}
    report = run.task("report")
    assert report.phase == "Succeeded", run.explain()
    text = Path(report.artifacts["markdown"]["uri"]).read_text()
    assert "incomplete" in text and "| prepared (config.json) | no |" in text
    assert "<html" in Path(report.artifacts["html"]["uri"]).read_text()
    assert stragglers(run.run_id) == []


def test_terminate_stops_every_pod_and_still_reports(s3_server, compiled, tmp_path):
    """KFP's Terminate sets activeDeadlineSeconds 0: Argo kills running pods, retries nothing, and still
    runs exit hooks (the twin's engine cites the sources)."""
    twin, args = twin_and_args(compiled, s3_server, tmp_path, 600_000)
    args["chaos"] = ""
    with twin.start(args) as ex:
        ex.wait_until(lambda r: r.task("syncer").attempts[0].started_real is not None, 90)
        time.sleep(5)  # learners and syncer training
        ex.terminate()
        run = ex.wait(120)
    assert run.terminated and run.phase == "Failed", run.explain()
    for task in run.find("learner") + run.find("syncer"):
        assert len(task.attempts) == 1 and task.attempts[0].phase in ("Failed", "Error"), run.explain()
    report = run.task("report")
    assert report.phase == "Succeeded" and Path(report.artifacts["html"]["uri"]).is_file(), run.explain()
    assert stragglers(run.run_id) == []
