"""The whole `pretrain` pipeline through the twin (a stand-in) in a platform team's namespace: labelled for Istio
injection, enforcing Pod Security `restricted` for the pods the package creates (KFP's own task pods are not
admitted by the twin: docs/cluster.md says what KFP 2.17's need), its workers under a Kueue queue with quota,
and store credentials from a web-identity token with no static keys: the namespace has no store Secret, an
identity webhook stand-in (identity.py, EKS IRSA) gives the run's service account and the workers' own one
(`pod_settings.service_account`) a role and a token file, and an STS stand-in on loopback (tests/_sts.py)
exchanges each token for the namespace's SeaweedFS keys. Learners, syncer, chaos kills, evaluation, SFT and
the report all finish. One run holds all four settings (each ~40 s of the suite): none of them changes what
another one checks, and the static-key path runs in `test_pretrain_pipeline.py`."""

from __future__ import annotations

import pytest
from ddiloco.pipelines.compile import compile_pipeline

from tests._sts import StsStandIn
from tests.twin import stragglers
from tests.twin.identity import WebIdentity
from tests.twin.test_pretrain_pipeline import twin_and_args

pytestmark = [pytest.mark.twin, pytest.mark.s3, pytest.mark.slow, pytest.mark.timeout(1200)]
LABELS = {"istio-injection": "enabled", "pod-security.kubernetes.io/enforce": "restricted"}
RUNNER_ROLE = "arn:aws:iam::111122223333:role/team-a-pipeline-runner"
WORKER_ROLE = "arn:aws:iam::111122223333:role/team-a-ddiloco-workers"


@pytest.fixture
def sts(s3_server):
    roles = {RUNNER_ROLE: "runner-jwt", WORKER_ROLE: "workers-jwt"}
    stand_in = StsStandIn(s3_server.access_key, s3_server.secret_key, roles).start()
    yield stand_in
    stand_in.stop()


def test_pretrain_runs_under_istio_pod_security_kueue_and_web_identity_with_no_static_keys(
    s3_server, sts, tmp_path
):
    path = compile_pipeline("pretrain", tmp_path / "pretrain.yaml", backoff="1s", keeper_poll_s=0.25)
    twin, args = twin_and_args(path, s3_server, tmp_path / "run", 150_000)
    twin.timeout_s = 240  # the run takes ~40 s; a refused, Pending or stuck pod must fail it, not hang
    twin.cluster.namespace_labels = dict(LABELS)
    twin.cluster.queues = {"team-a": {"cpu": "64", "memory": "1Ti", "nvidia.com/gpu": "8"}}
    del twin.cluster.secrets["mlpipeline-minio-artifact"]  # no static keys anywhere in the namespace
    identities = {}
    for account, role in (("pipeline-runner", RUNNER_ROLE), ("ddiloco-workers", WORKER_ROLE)):
        token = tmp_path / f"{account}.token"
        token.write_text(sts.roles[role])
        identities[account] = WebIdentity(role, str(token))
    twin.cluster.web_identities = identities
    twin.env["AWS_ENDPOINT_URL_STS"] = sts.url  # stands for the region's STS endpoint
    args["kueue_queue"] = "team-a"
    args["pod_settings"] = {"service_account": "ddiloco-workers"}
    with twin.start(args) as ex:
        run = ex.wait()
        seen = [*ex.workers.ended.values(), *ex.workers.list()]
        pods = list({p["metadata"]["name"]: p for p in seen}.values())
        refused = list(ex.workers.refused)
    assert run.phase == "Succeeded", run.explain()
    # Pod Security `restricted` admitted every pod the package created; Kueue queued them; Istio left them alone.
    assert refused == [] and pods
    assert all(p["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a" for p in pods)
    assert all(c["name"] != "istio-proxy" for p in pods for c in p["spec"]["containers"])
    # Web identity: task pods and workers each took their own role at STS.
    assert all(p["spec"]["serviceAccountName"] == "ddiloco-workers" for p in pods)
    assumed = {q.get("RoleArn") for q in sts.seen if q.get("Action") == "AssumeRoleWithWebIdentity"}
    assert assumed == {RUNNER_ROLE, WORKER_ROLE}, sts.seen
    incarnations = {p["metadata"]["labels"]["ddiloco.io/incarnation"] for p in pods}
    assert incarnations > {"0"}, incarnations  # the chaos kills' learners came back as new workers
    assert stragglers(run.run_id) == []
