"""Image names: `{registry}/ddiloco-{learner|syncer}:{version}-{source digest}` (built by images/build.sh).

Design choices:
- Tags are immutable: the package version alone never changes when code changes, and nodes that already
  pulled `:0.1.0` (imagePullPolicy IfNotPresent, KFP's default) would keep running stale code. The tag adds
  the first 12 hex digits of a SHA-256 over the Python sources the images install (`ddiloco/`, `components/`,
  `pipelines/`: every `*.py`, by relative path and content), so a compiled pipeline names exactly the image
  `images/build.sh` builds from the same tree, from a checkout or an installed wheel alike.
- Standard library only, and runnable as a script (`python3 components/images.py tag`): build.sh calls it
  before any dependency is installed.
- Not covered by the digest: the pinned dependency versions and the Dockerfiles; bump `__version__` when
  only those change.
"""

from __future__ import annotations

import hashlib
import re
import sys
from pathlib import Path

DEFAULT_REGISTRY = "ghcr.io/ddiloco"
LEARNER = "ddiloco-learner"
"""CUDA PyTorch: learners, and evaluation / SFT on the GPU pipeline."""
SYNCER = "ddiloco-syncer"
"""CPU PyTorch (slim): prepare, syncer, chaos, report, and every step of the CPU smoke pipeline."""
PACKAGES = ("ddiloco", "components", "pipelines")
"""The folders the images install (images/*.Dockerfile COPY them); their *.py files make the digest."""
SOURCE_ROOT = Path(__file__).resolve().parents[1]


def version(root: Path = SOURCE_ROOT) -> str:
    """`__version__` of ddiloco, read from the file (no import: this runs before ddiloco's dependencies)."""
    m = re.search(r'^__version__ = "([^"]+)"$', (root / "ddiloco" / "__init__.py").read_text(), re.M)
    if m is None:
        raise ValueError(f"cannot read __version__ from {root / 'ddiloco' / '__init__.py'}")
    return m.group(1)


def source_digest(root: Path = SOURCE_ROOT) -> str:
    """SHA-256 (hex) over the *.py files of the installed packages, sorted by relative path."""
    h = hashlib.sha256()
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if "__pycache__" in rel:
                continue
            data = path.read_bytes()
            h.update(f"{rel}\0{len(data)}\0".encode())
            h.update(data)
    return h.hexdigest()


def image_tag(root: Path = SOURCE_ROOT) -> str:
    """`{version}-{12 hex digits of the source digest}`, e.g. 0.1.0-3f2a9c1b7d4e."""
    return f"{version(root)}-{source_digest(root)[:12]}"


def image(name: str, registry: str = DEFAULT_REGISTRY, tag: str | None = None) -> str:
    if name not in (LEARNER, SYNCER):
        raise ValueError(f"unknown image {name!r}; use {LEARNER!r} or {SYNCER!r}")
    registry = registry.rstrip("/")
    if not registry:
        raise ValueError("the image registry must not be empty (e.g. ghcr.io/you or registry.local:5000)")
    return f"{registry}/{name}:{tag or image_tag()}"


if __name__ == "__main__":
    if sys.argv[1:] != ["tag"]:
        sys.exit("usage: python3 components/images.py tag")
    print(image_tag())
