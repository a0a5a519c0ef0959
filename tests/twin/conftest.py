"""Fixtures of the twin's own tests: compile a pipeline function, and check that a run leaves no process."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture
def compile_pipeline(tmp_path: Path) -> Callable[..., Path]:
    """compile_pipeline(pipeline_func) -> path of the compiled two-document YAML."""
    from kfp import compiler

    def go(func: Any, name: str = "pipeline.yaml") -> Path:
        path = tmp_path / name
        compiler.Compiler().compile(func, str(path))
        return path

    return go
