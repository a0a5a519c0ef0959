"""The compiled `pretrain` pipeline under a Kubeflow profile's own store key (KFP 2.17 multi-user): the twin's
SeaweedFS holds the per-namespace user and bucket policy the profile controller writes (tests/_kfp_profile.py)
and the pods get that key from the namespace's `mlpipeline-minio-artifact` Secret, as on a real cluster.

The whole run succeeding under that key is test_pretrain_pipeline.py's end-to-end run (its `pretrain_run` uses
this key). Here, the same run with a client that asks the bucket for its region (`DDILOCO_S3_REGION=auto`, what
the client did before it always knew its region) fails at the first step's first store call with AccessDenied:
GetBucketLocation is not granted to the profile."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from ddiloco.pipelines.compile import compile_pipeline

from tests._kfp_profile import SECRET, ProfileKey
from tests.twin import KFP_2_17, Cluster, Twin, stragglers

pytestmark = [pytest.mark.twin, pytest.mark.s3, pytest.mark.slow]

EXTRA_ENV = {"PYTHONPATH": os.environ["TWIN_PYTHONPATH"]} if os.environ.get("TWIN_PYTHONPATH") else {}
TINY = [
    "model.n_layer=1", "model.n_head=2", "model.n_embd=32", "model.seq_len=32", "train.batch_size=4",
    "data.synthetic_docs=600", "data.synthetic_entities=8", "diloco.fragments=2", "eval.val_batches=2",
    "train.checkpoint_every_s=1", "train.threads=1", "sft.steps=20",
]  # fmt: skip


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> Path:
    return compile_pipeline("pretrain", tmp_path_factory.mktemp("twin-compiled") / "pretrain.yaml")


def _run(key: ProfileKey, compiled: Path, work: Path, **env: str):
    cluster = Cluster(namespace=key.namespace, secrets={SECRET: key.secret()})
    twin = Twin(
        compiled, work, cluster=cluster, workflow_defaults=KFP_2_17, time_scale=60.0, timeout_s=420,
        env={"OMP_NUM_THREADS": "1", **EXTRA_ENV, **env},
    )  # fmt: skip
    # store_prefix is the pipeline's default, private/{namespace}/ddiloco
    args = {
        "recipe": "tiny-cpu",
        "overrides": TINY,
        "learners": 2,
        "token_budget": 600_000,
        "chaos": "",
        "store_bucket": key.bucket,
        "s3_endpoint": key.endpoint.split("://")[-1],
    }
    return twin.run(args)


def test_profile_identity_with_a_client_that_asks_for_the_region_fails(
    profile_s3: ProfileKey, compiled: Path, tmp_path: Path
):
    run = _run(profile_s3, compiled, tmp_path, DDILOCO_S3_REGION="auto")
    assert run.phase == "Failed", run.explain()
    prepare = run.task("prepare")
    assert prepare.phase == "Failed", run.explain()
    log = prepare.attempts[0].log.read_text()
    assert "AccessDenied" in log and "refused bucket check on bucket 'mlpipeline'" in log, log[-2000:]
    assert all(t.phase == "Omitted" for t in run.find("learner") + run.find("syncer")), run.explain()
    assert stragglers(run.run_id) == []
