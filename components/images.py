"""Image names: `{registry}/ddiloco-{learner|syncer}:{ddiloco.__version__}` (built by images/build.sh)."""

from __future__ import annotations

from ddiloco import __version__

DEFAULT_REGISTRY = "ghcr.io/ddiloco"
LEARNER = "ddiloco-learner"
"""CUDA PyTorch: learners, and evaluation / SFT on the GPU pipeline."""
SYNCER = "ddiloco-syncer"
"""CPU PyTorch (slim): prepare, syncer, chaos, report, and every step of the CPU smoke pipeline."""


def image(name: str, registry: str = DEFAULT_REGISTRY, tag: str = __version__) -> str:
    if name not in (LEARNER, SYNCER):
        raise ValueError(f"unknown image {name!r}; use {LEARNER!r} or {SYNCER!r}")
    registry = registry.rstrip("/")
    if not registry:
        raise ValueError("the image registry must not be empty (e.g. ghcr.io/you or registry.local:5000)")
    return f"{registry}/{name}:{tag}"
