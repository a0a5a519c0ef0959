"""The compiled `pretrain` pipeline when the stock `templateDefaults.retryStrategy` re-runs its whole run
group (the ExitHandler DAG holding prepare, learners, syncer, chaos, evaluate, SFT): the re-run must find
the run prepared and done, fire no chaos event again, and the run must still succeed with one report.

The group ends Error the way a real cluster makes it: the chaos pod is evicted in each of the three
attempts of its executor DAG (compiled with step_retries=0, so each attempt is one pod): chaos ends Error,
and the group with it once everything else in it has finished (dag.go assessDAGPhase).
"""

from __future__ import annotations

import json

import pytest
from ddiloco.pipelines.compile import compile_pipeline

from ddiloco.store.url import open_store
from tests.twin import stragglers
from tests.twin.test_pretrain_pipeline import KILLS_AT_S, NAMESPACE, twin_and_args

pytestmark = [pytest.mark.twin, pytest.mark.s3, pytest.mark.slow, pytest.mark.long, pytest.mark.timeout(1500)]
"""long: the stock whole-group retry is the fallback path (keepers bring roles back without it), and the
run goes through the pipeline twice (~100 s): `pytest -m long`."""


def test_the_run_group_ends_error_is_rerun_and_the_run_succeeds_without_redoing_prepare_or_chaos(
    s3_server, tmp_path
):
    path = compile_pipeline("pretrain", tmp_path / "pretrain.yaml", step_retries=0)
    twin, args = twin_and_args(path, s3_server, tmp_path / "twin", 100_000)
    twin.timeout_s = 900  # two passes over the group: the second one prepares nothing, trains nothing
    kills = [{"kind": "kill_learner", "learner": i, "at_s": t} for i, t in enumerate(KILLS_AT_S)]
    later = {"id": "later", "kind": "kill_learner", "learner": 0, "at_s": 36000}  # keeps chaos running
    args["chaos"] = json.dumps({"events": [*kills, later]})
    with twin.start(args) as ex:
        ex.wait_until(lambda r: sum(q["method"] == "DELETE" for q in r.api_requests) == 2, 180)
        store = open_store(
            f"s3://{s3_server.bucket}/private/{NAMESPACE}/ddiloco/{ex.record.run_id}", env=s3_server.env()
        )
        ex.wait_until(lambda r: len(store.list("chaos/k8s/")) == 2, 60)  # both kills recorded
        for k in range(3):  # evict the chaos pod in each attempt of its executor DAG
            ex.wait_until(lambda r, k=k: r.task("chaos").attempts[k].phase == "Running", 120)
            ex.delete_pod(NAMESPACE, ex.record.task("chaos").attempts[k].pod_name, 0)
        run = ex.wait()
    assert run.phase == "Succeeded", run.explain()
    first, again = run.tasks["exit-handler-1/chaos"], run.tasks["exit-handler-1(1)/chaos"]
    assert first.phase == "Error" and [a.message for a in first.attempts] == ["pod deleted"] * 3
    assert [a.node_name.split(".")[-2] for a in first.attempts] == ["chaos(0)", "chaos(1)", "chaos(2)"]
    assert (
        again.phase == "Succeeded"
        and ".exit-handler-1(1).chaos(0).executor(0)" in again.attempts[0].node_name
    )
    preps = run.find("prepare")
    assert [t.key for t in preps] == ["exit-handler-1(1)/prepare", "exit-handler-1/prepare"]
    assert all(t.phase == "Succeeded" for t in preps)
    assert "already prepared" in preps[0].attempts[0].log.read_text()  # the re-run only verified
    for name in ("syncer", "evaluate", "sft", "evaluate-2"):
        assert [t.phase for t in run.find(name)] == ["Succeeded", "Succeeded"], (name, run.explain())
    # chaos fired each kill once, in the first attempt; no attempt after it fired anything
    deletes = [q["path"].rsplit("/", 1)[-1] for q in run.api_requests if q["method"] == "DELETE"]
    assert len(deletes) == 2 and len(set(deletes)) == 2, deletes
    records = {k: store.get_json(k) for k in store.list("chaos/k8s/")}
    assert sorted(r["action"] for r in records.values()) == ["deleted pod", "deleted pod"], records
    starts = store.get_json("chaos-steps/k8s.json")["started_at"]  # evicted attempts may die before
    assert 2 <= len(starts) <= 4, starts  # noting theirs: the first and the group's re-run always do
    # the report ran once, after the group's last attempt
    report = run.task("report")
    assert report.phase == "Succeeded" and len(report.attempts) == 1, run.explain()
    assert ".exit-handler-1.onExit(0).report(0).executor(0)" in report.attempts[0].node_name
    assert stragglers(run.run_id) == []
