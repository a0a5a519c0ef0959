"""S3Store with a Kubeflow profile's key (tests/_kfp_profile.py: KFP 2.17's profile controller's per-namespace
user and bucket policy on SeaweedFS): every call the store makes is granted under the namespace's prefixes,
other namespaces stay closed, and a client that asks the bucket for its region is refused at its first call."""

from __future__ import annotations

import uuid

import pytest

from ddiloco.store.base import Store, StoreConfigError
from ddiloco.store.retry import RetryPolicy
from ddiloco.store.s3 import S3Store
from ddiloco.store.url import open_store
from tests._kfp_profile import ProfileKey
from tests._store_contract import CONTRACT, ContractCheck

pytestmark = pytest.mark.s3

FAST = RetryPolicy(max_attempts=3, base_delay=0.01, max_delay=0.05, deadline=3.0)


def _store(key: ProfileKey, prefix: str, **env: str) -> Store:
    return open_store(key.url(f"{prefix}/t-{uuid.uuid4().hex[:12]}"), env={**key.env(), **env}, retry=FAST)


@pytest.mark.parametrize("check", CONTRACT, ids=lambda c: c.__name__)
def test_profile_identity_contract(profile_s3: ProfileKey, check: ContractCheck) -> None:
    """The whole store contract (puts, gets, stats, lists, deletes, batch deletes, creates and their probe)
    under the default pipeline prefix private/{namespace}/."""
    check(_store(profile_s3, f"private/{profile_s3.namespace}/ddiloco"))


@pytest.mark.parametrize("prefix", ["private-artifacts/{ns}/ddiloco", "shared/ddiloco", "artifacts/ddiloco"])
def test_profile_identity_other_granted_prefixes(profile_s3: ProfileKey, prefix: str) -> None:
    store = _store(profile_s3, prefix.format(ns=profile_s3.namespace))
    assert store.create("a/b", b"1") and not store.create("a/b", b"2")
    assert store.list("a") == ["a/b"] and store.get("a/b") == b"1" and store.exists("a/b")
    assert store.delete_prefix("") == 1 and store.list("") == []


def test_profile_identity_cannot_reach_another_namespace(profile_s3: ProfileKey) -> None:
    store = _store(profile_s3, "private/team-b/ddiloco")
    for call in (lambda: store.put("x", b"1"), lambda: store.get("x"), lambda: store.list("")):
        with pytest.raises(StoreConfigError, match="AccessDenied.*namespace's prefixes"):
            call()


def test_profile_identity_denies_a_client_that_asks_the_bucket_for_its_region(profile_s3: ProfileKey) -> None:
    """DDILOCO_S3_REGION=auto is the client as it was: minio's first call on the bucket is GetBucketLocation,
    which the profile's policy does not grant, so even the first call inside its own prefix is refused."""
    store = _store(profile_s3, f"private/{profile_s3.namespace}/ddiloco", DDILOCO_S3_REGION="auto")
    assert isinstance(store, S3Store) and store._conn.settings.client_region is None
    with pytest.raises(StoreConfigError, match="AccessDenied"):
        store.put("x", b"1")
