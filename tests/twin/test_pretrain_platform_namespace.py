"""The whole `pretrain` pipeline through the twin (a stand-in) in a platform team's namespace: labelled for Istio
injection, enforcing Pod Security `restricted` for the pods the package creates (KFP's own task pods are not
admitted by the twin: docs/cluster.md says what KFP 2.17's need), and its workers under a Kueue queue with
quota. Learners, syncer, chaos kills, evaluation, SFT and the report all finish."""

from __future__ import annotations

import pytest
from ddiloco.pipelines.compile import compile_pipeline

from tests.twin import stragglers
from tests.twin.test_pretrain_pipeline import twin_and_args

pytestmark = [pytest.mark.twin, pytest.mark.s3, pytest.mark.slow, pytest.mark.timeout(1200)]
LABELS = {"istio-injection": "enabled", "pod-security.kubernetes.io/enforce": "restricted"}


def test_pretrain_runs_in_an_istio_pod_security_restricted_kueue_namespace(s3_server, tmp_path):
    path = compile_pipeline("pretrain", tmp_path / "pretrain.yaml", backoff="1s", keeper_poll_s=0.25)
    twin, args = twin_and_args(path, s3_server, tmp_path / "run", 150_000)
    twin.timeout_s = 240  # the run takes ~40 s; a worker stuck Running must fail it, not hang
    twin.cluster.namespace_labels = dict(LABELS)
    twin.cluster.queues = {"team-a": {"cpu": "64", "memory": "1Ti", "nvidia.com/gpu": "8"}}
    args["kueue_queue"] = "team-a"
    with twin.start(args) as ex:
        run = ex.wait()
        seen = [*ex.workers.ended.values(), *ex.workers.list()]
        pods = list({p["metadata"]["name"]: p for p in seen}.values())
        refused = list(ex.workers.refused)
    assert run.phase == "Succeeded", run.explain()
    assert refused == [] and pods
    assert all(p["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a" for p in pods)
    assert all(c["name"] != "istio-proxy" for p in pods for c in p["spec"]["containers"])
    incarnations = {p["metadata"]["labels"]["ddiloco.io/incarnation"] for p in pods}
    assert incarnations > {"0"}, incarnations  # the chaos kills' learners came back as new workers
    assert stragglers(run.run_id) == []
