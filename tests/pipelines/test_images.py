"""The image definitions, checked without a container engine: tags, users, contents, no secrets."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from ddiloco.components.images import LEARNER, SYNCER, image

ROOT = Path(__file__).resolve().parents[2]
IMAGES = ROOT / "images"


def test_build_script_tags_images_as_the_components_name_them():
    out = subprocess.run(
        ["bash", str(IMAGES / "build.sh"), "registry.example:5000/team/", "--push", "--dry-run"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    for name in (LEARNER, SYNCER):
        tag = image(name, "registry.example:5000/team")
        assert f"build -f images/{name.removeprefix('ddiloco-')}.Dockerfile -t {tag} ." in out
        assert f"push {tag}" in out
    assert subprocess.run(["bash", str(IMAGES / "build.sh")], capture_output=True).returncode == 2


@pytest.mark.parametrize("name", ["learner", "syncer"])
def test_dockerfile_runs_as_non_root_from_the_repository_without_secrets(name):
    text = (IMAGES / f"{name}.Dockerfile").read_text()
    users = re.findall(r"^USER (\S+)", text, re.M)
    assert users and not users[-1].startswith(("0", "root")), "the image must run as a non-root user"
    # this repo + kfp + lm-evaluation-harness (evaluate --harness lm-eval) + pyarrow (tokenize), exactly as
    # locked: the lock's runtime set is checked against pyproject in tests/unit/test_lock.py
    assert f"COPY requirements/{name}.lock /wheels/requirements.lock" in text
    assert re.search(
        r"pip install --require-hashes --no-deps (?:--extra-index-url \S+ )?-r /wheels/requirements\.lock",
        text,
    )
    assert "pip install --no-deps /wheels/ddiloco-*.whl" in text
    assert not re.search(r"(?i)(secret|password|token|access_?key)\s*=", text)
    lines = (IMAGES / f"{name}.Dockerfile.dockerignore").read_text().splitlines()
    ignore = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    assert ignore[0] == "*" and "!ddiloco/" in ignore, "send only what the image installs"
    for copied in re.findall(r"^COPY (?!--from)(\S+)", text, re.M):
        assert f"!{copied}/" in ignore or f"!{copied}" in ignore, (
            f"{copied} is excluded from the build context"
        )


def test_the_tag_is_version_plus_a_digest_of_the_installed_sources(tmp_path):
    """Immutable tags: a code change gives a new tag (nodes never run a stale image under an old tag), and
    build.sh computes the same tag as the compiled pipeline (components/images.py, stdlib only)."""
    import shutil

    from ddiloco.components.images import PACKAGES, image_tag, source_digest, version

    tag = image_tag()
    assert re.fullmatch(rf"{re.escape(version())}-[0-9a-f]{{12}}", tag)
    out = subprocess.run(
        ["bash", str(IMAGES / "build.sh"), "r.example", "--dry-run"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert f"-t r.example/ddiloco-syncer:{tag} ." in out
    copy = tmp_path / "src"
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, copy / pkg, ignore=shutil.ignore_patterns("__pycache__", "*.yaml"))
    assert source_digest(copy) == source_digest(ROOT), "YAML and caches are not part of the image's sources"
    (copy / "ddiloco" / "learner" / "loop.py").write_text(
        (ROOT / "ddiloco" / "learner" / "loop.py").read_text() + "\n# changed\n"
    )
    assert source_digest(copy) != source_digest(ROOT)
