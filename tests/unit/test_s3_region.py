"""The region the S3 client signs with: never left for minio to ask the bucket unless told to."""

from __future__ import annotations

import pytest

from ddiloco.store.s3 import S3Settings

BASE = {"DDILOCO_S3_ACCESS_KEY": "k", "DDILOCO_S3_SECRET_KEY": "s"}


@pytest.mark.parametrize(
    ("endpoint", "extra", "region"),
    [
        ("seaweedfs.kubeflow:9000", {}, "us-east-1"),
        ("http://127.0.0.1:8333", {}, "us-east-1"),
        ("[::1]:9000", {}, "us-east-1"),
        ("seaweedfs.kubeflow:9000", {"AWS_REGION": "eu-west-1"}, "eu-west-1"),
        ("seaweedfs.kubeflow:9000", {"AWS_DEFAULT_REGION": "eu-west-2"}, "eu-west-2"),
        ("minio:9000", {"DDILOCO_S3_REGION": "eu-central-1", "AWS_REGION": "x"}, "eu-central-1"),
        ("seaweedfs.kubeflow:9000", {"DDILOCO_S3_REGION": "auto"}, None),
        ("https://s3.amazonaws.com", {}, None),  # minio takes it from the host or the bucket
        ("https://s3.eu-west-1.amazonaws.com", {"AWS_REGION": "eu-west-1"}, "eu-west-1"),
    ],
)
def test_client_region(endpoint: str, extra: dict[str, str], region: str | None) -> None:
    settings = S3Settings.from_env({**BASE, "DDILOCO_S3_ENDPOINT": endpoint, **extra})
    assert settings.client_region == region
