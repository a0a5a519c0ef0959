"""A multi-node learner through the twin: the `pretrain` pipeline compiled with `learner_nodes=2`, one learner
whose keeper creates a Kubeflow Trainer TrainJob (tests/twin/trainjobs.py: two node pods, each a torchrun
agent with its rank on gloo over loopback, WORLD_SIZE 2). Node 1's pod is lost mid-run (force-deleted, as
the pod GC does after its node is gone); the Job would replace it alone, but the keeper ends the incarnation:
it deletes the TrainJob in the foreground and starts the next one, whose two nodes rejoin from the learner's
checkpoint (components/trainjob.py). The run finishes with the ledger balanced and nothing left running.
"""

from __future__ import annotations

import time

import pytest
from ddiloco.components.keeper import Slot
from ddiloco.pipelines.compile import compile_pipeline

from ddiloco.posttrain.summary import build_summary
from ddiloco.store.url import open_store
from tests.twin import stragglers
from tests.twin.test_pretrain_pipeline import NAMESPACE, TINY, twin_and_args

pytestmark = [pytest.mark.twin, pytest.mark.s3, pytest.mark.slow, pytest.mark.long, pytest.mark.timeout(1200)]
NODES, PER_NODE = 2, 1
TOKEN_BUDGET = 60_000
FAST = {"backoff": "1s", "keeper_poll_s": 0.25}


def _log(path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _nodes(ex, name: str) -> dict[str, dict]:
    """completion index -> the node pod of TrainJob `name`, as the API serves it."""
    out = {}
    for pod in ex.workers.list():
        labels = pod["metadata"]["labels"]
        if labels.get("jobset.sigs.k8s.io/jobset-name") == name:
            out[labels["batch.kubernetes.io/job-completion-index"]] = pod
    return out


def _training(ex, name: str) -> bool:
    """Both nodes of TrainJob `name` Running and its rank 0 (node 0) joined the run."""
    nodes = _nodes(ex, name)
    return (
        len(nodes) == NODES
        and all(p["status"]["phase"] == "Running" for p in nodes.values())
        and "joined run" in _log(ex.workers.log(nodes["0"]["metadata"]["name"]))
    )


def test_a_trainjob_learner_that_loses_a_node_restarts_whole_and_the_ledger_balances(s3_server, tmp_path):
    path = compile_pipeline("pretrain", tmp_path / "pretrain.yaml", learner_nodes=NODES, **FAST)
    twin, args = twin_and_args(path, s3_server, tmp_path / "run", TOKEN_BUDGET)
    twin.timeout_s = 900
    args.update(learners=1, chaos="", overrides=[*TINY, f"train.ranks={NODES * PER_NODE}"])
    t0 = time.monotonic()
    with twin.start(args) as ex:
        run = ex.wait_until(lambda r: len(r.find("learner")) == 1 and r.find("learner")[0].attempts, 120)
        slot = Slot("learner", run.run_id, 0)
        first, second = slot.name(0), slot.name(1)
        ex.wait_until(lambda r: _training(ex, first), 300)
        with ex.lock:
            lost = _nodes(ex, first)["1"]["metadata"]["name"]
            ex.delete_pod(NAMESPACE, lost, 0)  # node 1 is gone: its pod object is removed at once
        ex.wait_until(lambda r: _training(ex, second), 300)
        run = ex.wait()
        jobs = {**ex.trainjobs.ended, **{n: j.json() for n, j in ex.trainjobs.jobs.items()}}
        logs = {name: _log(ex.workers.log(name)) for name in ex.workers.ended}
    seconds = time.monotonic() - t0
    assert run.phase == "Succeeded", run.explain()
    (keeper,) = run.find("learner")
    assert [a.phase for a in keeper.attempts] == ["Succeeded"], run.explain()
    tail = keeper.attempts[0].tail(4000)
    assert f"started worker {first}" in tail and f"started worker {second}" in tail, tail
    assert "infrastructure" in tail and "node 1" in tail, tail  # the lost node, not its peer's crash
    # The first TrainJob went in the foreground (deletionTimestamp while its pods went), the second completed.
    assert "deletionTimestamp" in jobs[first]["metadata"], jobs[first]
    assert [c["type"] for c in jobs[second]["status"]["conditions"]] == ["Complete"], jobs[second]
    # Each node of the second TrainJob ran its own rank of one torch job of WORLD_SIZE 2.
    second_logs = [text for name, text in logs.items() if name.startswith(f"{second}-node-0-")]
    assert len(second_logs) == NODES and any("joined run" in t for t in second_logs)
    store = open_store(
        f"s3://{s3_server.bucket}/private/{NAMESPACE}/ddiloco/{run.run_id}", env=s3_server.env()
    )
    s = build_summary(store)
    assert s.status == "done" and s.ledger_balanced and s.global_versions_contiguous, s
    assert s.tokens_outstanding == 0
    assert s.incarnations["0"] == 2, s.incarnations  # the lost node restarted the learner whole, once
    assert stragglers(run.run_id) == []
    print(f"trainjob run: {seconds:.0f} s")
