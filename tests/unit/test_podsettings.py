"""The cluster settings on the pods the package creates (components/podsettings.py): the run-time parameters
`kueue_queue` and `pod_settings` read strictly, and what a worker pod and a TrainJob carry of them."""

from __future__ import annotations

import dataclasses

import pytest
from ddiloco.components import trainjob as tj
from ddiloco.components.keeper import Slot, worker_manifest
from ddiloco.components.podsettings import QUEUE_LABEL, RUN_AS, PodSettings

from tests.unit.test_keeper import KEEPER_POD, SPEC

AFFINITY = {
    "nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [{"key": "pool", "operator": "In", "values": ["a"]}]}]
        }
    }
}
SETTINGS = PodSettings.of(
    "team-a-gpu",
    {
        "priority_class": "training-high",
        "affinity": AFFINITY,
        "image_pull_secrets": ["regcred"],
        "labels": {"team": "a", "ddiloco.io/role": "not-mine"},
        "annotations": {"cost-center": "42"},
        "service_account": "ddiloco-store",
    },
)
SLOT = Slot("learner", "r", 0)


def test_pod_settings_are_read_strictly():
    assert PodSettings.of("", {}) == PodSettings()
    with pytest.raises(ValueError, match="unknown keys \\['priority'\\]"):
        PodSettings.of("", {"priority": "x"})
    with pytest.raises(ValueError, match="image_pull_secrets"):
        PodSettings.of("", {"image_pull_secrets": "regcred"})
    with pytest.raises(ValueError, match="labels"):
        PodSettings.of("", {"labels": ["a"]})


def test_a_worker_pod_carries_the_queue_priority_affinity_pull_secrets_and_extra_metadata():
    pod = worker_manifest(SLOT, 0, dataclasses.replace(SPEC, settings=SETTINGS), KEEPER_POD)
    meta, spec = pod["metadata"], pod["spec"]
    assert meta["labels"][QUEUE_LABEL] == "team-a-gpu" and meta["labels"]["team"] == "a"
    assert meta["labels"]["ddiloco.io/role"] == "learner"  # the package's own labels win
    assert meta["annotations"]["cost-center"] == "42"
    assert meta["annotations"]["sidecar.istio.io/inject"] == "false"
    assert spec["priorityClassName"] == "training-high" and spec["affinity"] == AFFINITY
    assert spec["imagePullSecrets"] == [{"name": "regcred"}]
    assert spec["serviceAccountName"] == "ddiloco-store"  # the identity the store's role is bound to
    assert spec["securityContext"]["runAsUser"] == RUN_AS and spec["securityContext"]["runAsNonRoot"]


def test_the_worker_pod_with_every_setting_validates_strictly_against_the_kubernetes_schema():
    from tests.unit.test_manifests import K8S_VERSIONS, validate_strict

    pod = worker_manifest(SLOT, 0, dataclasses.replace(SPEC, settings=SETTINGS), KEEPER_POD)
    for version in K8S_VERSIONS:
        validate_strict(pod, version)


def test_a_trainjob_carries_the_queue_itself_and_the_rest_on_its_node_pods():
    """Kueue's TrainJob integration reads the queue label of the TrainJob (not of its pods); PodSpecPatch
    (trainer trainjob_types.go) has affinity, imagePullSecrets and securityContext, no priorityClassName."""
    spec = dataclasses.replace(SPEC, settings=SETTINGS)
    m = tj.trainjob_manifest(SLOT, 0, spec, KEEPER_POD, nodes=2, procs_per_node=1)
    assert m["metadata"]["labels"][QUEUE_LABEL] == "team-a-gpu"
    (patch,) = m["spec"]["runtimePatches"]
    (rjob,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    template = rjob["template"]["spec"]["template"]
    assert QUEUE_LABEL not in template["metadata"]["labels"]
    assert template["metadata"]["labels"]["team"] == "a"
    assert template["metadata"]["annotations"]["cost-center"] == "42"
    assert template["spec"]["affinity"] == AFFINITY
    assert template["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
    assert template["spec"]["serviceAccountName"] == "ddiloco-store"  # PodSpecPatch.serviceAccountName
    assert "priorityClassName" not in template["spec"]


def test_the_images_run_as_the_uid_the_pods_declare():
    """runAsUser must be the user the images create (a uid the image has: HOME and caches are its own)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "images"
    for name in ("learner.Dockerfile", "syncer.Dockerfile"):
        text = (root / name).read_text()
        assert f"useradd --uid {RUN_AS}" in text and f"USER {RUN_AS}:{RUN_AS}" in text, name
