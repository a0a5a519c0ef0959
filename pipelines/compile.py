"""Compile the pipelines to KFP YAML. The committed `pipelines/{pretrain,smoke,join}.yaml` are these functions'
output with default options; `tests/pipelines/test_compile.py` compares them (UPDATE_GOLDEN=1 rewrites)."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path
from typing import Any

from ddiloco.pipelines import join, smoke
from ddiloco.pipelines.pretrain import ClusterOptions, pipeline_function
from kfp import compiler

HERE = Path(__file__).resolve().parent
PIPELINES: dict[str, ClusterOptions] = {
    "pretrain": ClusterOptions(),
    "smoke": smoke.OPTIONS,
    "join": join.OPTIONS,
}
BUILDERS = {"join": join.pipeline_function}
"""Pipelines built by another function than pretrain's `pipeline_function`."""


def golden_path(name: str) -> Path:
    return HERE / f"{name}.yaml"


def options(name: str, **changes: Any) -> ClusterOptions:
    """The named pipeline's options with compile-time changes (None values are ignored)."""
    if name not in PIPELINES:
        raise ValueError(f"unknown pipeline {name!r}; choose one of {', '.join(PIPELINES)}")
    return dataclasses.replace(PIPELINES[name], **{k: v for k, v in changes.items() if v is not None})


def compile_pipeline(name: str, out: str | Path, **changes: Any) -> Path:
    """Write the compiled pipeline (the IR YAML KFP uploads and runs) to `out`."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    builder = BUILDERS.get(name, pipeline_function)
    compiler.Compiler().compile(builder(options(name, **changes)), str(out))
    out.write_text(stable_header(out.read_text()))
    return out


_DEFAULT = re.compile(r"^(#\s+\w+: \w+ \[Default: )(.*)(\])$")


def _sorted(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _sorted(value[k]) for k in sorted(value)}
    if isinstance(value, list):
        return [_sorted(v) for v in value]
    return value


def stable_header(text: str) -> str:
    """KFP's `# Inputs:` header prints dict defaults in protobuf map order, which changes from one process to
    the next; sort their keys so the committed YAML is byte-for-byte reproducible (the spec itself is)."""
    lines = text.split("\n")
    for i, line in enumerate(lines):
        if not line.startswith("#"):
            break
        m = _DEFAULT.match(line)
        if m is not None:
            try:
                lines[i] = f"{m[1]}{_sorted(ast.literal_eval(m[2]))!r}{m[3]}"
            except (ValueError, SyntaxError):
                pass
    return "\n".join(lines)
