"""The compiled `pretrain` pipeline through the twin on STOCK KFP 2.17 defaults (templateDefaults retryPolicy
OnError, no overlay) while the cluster preempts, evicts, OOM-kills and rejects at admission (after a force
delete, kubernetes#130145) the worker pods of both learners and of the syncer, each once per kind, and
preempts and drains keeper pods: with the keepers (the default, components/keeper.py) the run succeeds.

Without the keepers (`keeper=False`, the roles in the task pods) the first preemption or eviction of a
learner or the syncer ends its task Failed, never retried (Argo operator.go inferFailedReason; the last
test shows it).
"""

from __future__ import annotations

import time

import pytest

from ddiloco.store.url import open_store
from tests.twin import stragglers
from tests.twin.test_pretrain_pipeline import NAMESPACE, twin_and_args

pytestmark = [pytest.mark.twin, pytest.mark.s3, pytest.mark.slow, pytest.mark.timeout(1200)]
ROUNDS = (  # (learner 0, learner 1, syncer): every role's worker meets every kind once
    ("preempt", "evict", "oom"),
    ("oom", "admission", "preempt"),
    ("evict", "preempt", "admission"),
    ("admission", "oom", "evict"),
)
KEEPER_HITS = {"learner-0": "preempt", "syncer": "drain"}
TOKEN_BUDGET = 150_000
FAST = {"backoff": "1s", "keeper_poll_s": 0.25}
"""Compile-time options: a worker comes back 1 s after it ended, keepers look every 0.25 s."""


def _log(path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _workers(ex) -> dict[str, dict]:
    """slot (learner-0, learner-1, syncer) -> its newest worker pod, as the API serves it."""
    out: dict[str, dict] = {}
    for pod in ex.workers.list():
        labels = pod["metadata"]["labels"]
        slot = labels["ddiloco.io/role"] + (
            f"-{labels['ddiloco.io/learner-id']}" if "ddiloco.io/learner-id" in labels else ""
        )
        if slot not in out or int(labels["ddiloco.io/incarnation"]) > int(
            out[slot]["metadata"]["labels"]["ddiloco.io/incarnation"]
        ):
            out[slot] = pod
    return out  # fmt: skip


def _keepers(run) -> dict[str, object]:
    learners = sorted(
        run.find("learner"), key=lambda t: t.executor_input["inputs"]["parameterValues"]["learner_id"]
    )
    return {"learner-0": learners[0], "learner-1": learners[1], "syncer": run.task("syncer")}  # fmt: skip


def _ready(ex, hit: dict[str, int]) -> bool:
    """All three workers Running with their role up (a learner joined, the syncer holds the lease), each a
    newer incarnation than the one hit last (`hit`: slot -> incarnation)."""
    workers = _workers(ex)
    if len(workers) != 3:
        return False
    for slot, pod in workers.items():
        if pod["status"]["phase"] != "Running" or int(
            pod["metadata"]["labels"]["ddiloco.io/incarnation"]
        ) <= hit.get(slot, -1):
            return False
        marker = "took the lease" if slot == "syncer" else "joined run"
        if marker not in _log(ex.workers.log(pod["metadata"]["name"])):
            return False
    return all(t.attempts[-1].phase == "Running" for t in _keepers(ex.record).values())


def _adopted(task) -> bool:
    """The keeper task's newest attempt is a retry that adopted the live worker."""
    return len(task.attempts) > 1 and "adopted live worker" in _log(task.attempts[-1].log)


def _in_emissary_window(ex, pod: str) -> bool:
    """The emissary's next wait4 poll is at least 0.5 s away (tests/twin/pods.py): the keeper's window after a
    SIGTERM is then wide enough that the test measures the keeper, not the race (docs/cluster.md)."""
    node, _ = ex.pods[pod]
    return (time.monotonic() - node.state["proc"].started) % 1.0 < 0.5


@pytest.fixture(scope="module")
def keeper_run(s3_server, tmp_path_factory):
    from ddiloco.pipelines.compile import compile_pipeline

    work = tmp_path_factory.mktemp("twin-keeper")
    twin, args = twin_and_args(
        compile_pipeline("pretrain", work / "pretrain.yaml", **FAST), s3_server, work, TOKEN_BUDGET
    )
    twin.timeout_s, args["chaos"] = 900, ""
    hits: dict[str, list[str]] = {"learner-0": [], "learner-1": [], "syncer": []}
    t0 = time.monotonic()
    with twin.start(args) as ex:
        last: dict[str, int] = {}
        ex.wait_until(lambda r: _ready(ex, last), 300)
        for slot, kind in KEEPER_HITS.items():  # keepers taken away: retried, they adopt the live worker
            pod = _keepers(ex.record)[slot].attempts[-1].pod_name
            ex.wait_until(lambda r, pod=pod: _in_emissary_window(ex, pod), 5, poll_s=0.01)
            ex.inject(pod, kind)
        ex.wait_until(lambda r: all(_adopted(_keepers(r)[slot]) for slot in KEEPER_HITS), 120)
        for kinds in ROUNDS:
            ex.wait_until(lambda r: _ready(ex, last), 300)
            with ex.lock:
                for (slot, pod), kind in zip(sorted(_workers(ex).items()), kinds, strict=True):
                    ex.inject(pod["metadata"]["name"], kind)
                    hits[slot].append(pod["metadata"]["name"])
                    last[slot] = int(pod["metadata"]["labels"]["ddiloco.io/incarnation"])
        run = ex.wait()
        ended = dict(ex.workers.ended)
    return run, s3_server, hits, ended, time.monotonic() - t0


def test_learners_survive_preempt_evict_oom_admission_on_stock_kfp_217_with_the_keeper(keeper_run):
    run, s3, hits, ended, seconds = keeper_run
    assert run.phase == "Succeeded", run.explain()
    for slot in ("learner-0", "learner-1"):
        task = _keepers(run)[slot]
        assert task.phase == "Succeeded", run.explain()
        for name in hits[slot]:  # every worker hit ended as the cluster ends it, and a new one came
            assert name in ended, (name, sorted(ended))
    store = open_store(f"s3://{s3.bucket}/private/{NAMESPACE}/ddiloco/{run.run_id}", env=s3.env())
    for lid in range(2):  # after each hit a new worker came back as the same learner
        incarnations = {
            k.split("/")[2] for k in store.list(f"learners/{lid:03d}/") if k.endswith("report.json")
        }
        assert max(incarnations) == f"inc-{len(ROUNDS):04d}", (lid, incarnations)  # one more per hit
    assert stragglers(run.run_id) == []
    print(f"keeper run: {seconds:.0f} s")


def test_the_syncer_survives_preempt_evict_oom_admission_on_stock_kfp_217_with_the_keeper(keeper_run):
    run, s3, hits, ended, _ = keeper_run
    assert run.phase == "Succeeded", run.explain()
    assert all(name in ended for name in hits["syncer"])
    store = open_store(f"s3://{s3.bucket}/private/{NAMESPACE}/ddiloco/{run.run_id}", env=s3.env())
    assert store.exists("done.json") and store.exists("final/model.safetensors")
    assert run.task("evaluate").phase == "Succeeded" and run.task("report").phase == "Succeeded"


def test_preempted_and_drained_keepers_are_retried_by_stock_kfp_217_and_adopt_their_worker(keeper_run):
    run, _, hits, _, _ = keeper_run
    for slot in KEEPER_HITS:
        first, *rest = _keepers(run)[slot].attempts
        assert (first.phase, first.message) == ("Error", "pod deleted"), run.explain()
        adopted = rest[0].tail(400)
        assert f"adopted live worker {hits[slot][0]}" in adopted, adopted  # incarnation 0 kept running


def test_without_the_keeper_preempted_and_evicted_roles_fail_the_run_on_stock_kfp_217(s3_server, tmp_path):
    from ddiloco.pipelines.compile import compile_pipeline

    yaml_path = compile_pipeline("pretrain", tmp_path / "pretrain.yaml", keeper=False, **FAST)
    twin, args = twin_and_args(yaml_path, s3_server, tmp_path, TOKEN_BUDGET)
    args["chaos"] = ""
    with twin.start(args) as ex:
        run = ex.wait_until(
            lambda r: r.task("syncer").attempts[-1].phase == "Running" and "took the lease" in _log(r.task("syncer").attempts[-1].log)
            and len(r.find("learner")) == 2 and all(t.attempts and t.attempts[-1].phase == "Running" for t in r.find("learner")),
            300,
        )  # fmt: skip
        ex.inject(run.task("syncer").attempts[-1].pod_name, "preempt")
        ex.inject(run.find("learner")[0].attempts[-1].pod_name, "evict")
        run = ex.wait_until(lambda r: r.task("syncer").done and r.find("learner")[0].done, 60)
        syncer, learner = run.task("syncer"), run.find("learner")[0]
        ex.terminate()
    for task in (syncer, learner):
        assert task.phase == "Failed" and len(task.attempts) == 1, run.explain()
        assert "not retried: retryPolicy OnError" in task.reason, task.reason
