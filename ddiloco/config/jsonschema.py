"""A JSON schema of the run config (`--config FILE.yaml`, the pipelines' overrides) for editors, generated from
the config dataclasses: their fields, types, defaults and attribute docstrings. The committed copy is
docs/config.schema.json (`python -m ddiloco.config.jsonschema > docs/config.schema.json`; a test keeps it equal).

An editor with the YAML language server checks a config file that starts with
`# yaml-language-server: $schema=<path or URL of docs/config.schema.json>`. The schema refuses unknown keys,
as `ddiloco.config.overrides` does; value ranges and cross-field rules stay with each section's `validate()`.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import textwrap
import types
import typing
from typing import Any

from ddiloco.config.recipes import RECIPES
from ddiloco.config.run import RunConfig

_SCALARS = {bool: "boolean", int: "integer", float: "number", str: "string"}


def field_docs(cls: type) -> dict[str, str]:
    """The docstrings written under the fields of dataclass `cls` (the string right after `name: type`)."""
    try:
        body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body  # type: ignore[attr-defined]
    except (OSError, TypeError):
        return {}
    docs = {}
    for stmt, after in zip(body, body[1:], strict=False):
        is_doc = isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and is_doc:
            docs[stmt.target.id] = " ".join(str(after.value.value).split())  # type: ignore[attr-defined]
    return docs


def _type(hint: Any, default: Any) -> dict[str, Any]:
    args = typing.get_args(hint)
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        options = [_type(a, default) for a in args if a is not type(None)]
        return {"anyOf": [*options, {"type": "null"}]} if type(None) in args else {"anyOf": options}
    if dataclasses.is_dataclass(hint):
        return section(hint, default if dataclasses.is_dataclass(default) else hint())  # type: ignore[arg-type]
    if hint in _SCALARS:
        return {"type": _SCALARS[hint]}
    origin = typing.get_origin(hint) or hint
    if origin is list:
        return {"type": "array", "items": _type(args[0], None) if args else {}}
    if origin is dict:
        return {"type": "object"}
    return {}


def section(cls: type, instance: Any) -> dict[str, Any]:
    """The schema of one config section (a dataclass) with `instance`'s values as defaults."""
    hints, docs = typing.get_type_hints(cls), field_docs(cls)
    props = {}
    for f in dataclasses.fields(cls):
        value = getattr(instance, f.name)
        prop = _type(hints[f.name], value)
        if f.name in docs:
            prop = {"description": docs[f.name], **prop}
        if value is None or isinstance(value, bool | int | float | str | list):
            prop["default"] = value
        props[f.name] = prop
    return {"type": "object", "properties": props, "additionalProperties": False}


def schema() -> dict[str, Any]:
    """The JSON schema (draft 2020-12) of a run config file: the sections, plus the file's `recipe`."""
    root = section(RunConfig, RunConfig())
    recipe = {"description": "The recipe the file starts from (`--recipe` wins).", "enum": list(RECIPES)}
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "ddiloco run config",
        "description": "A ddiloco run config file (--config FILE.yaml); defaults are the dataclasses' own.",
        **root,
        "properties": {"recipe": recipe, **root["properties"]},
    }


def render() -> str:
    """The schema as the committed file holds it."""
    return json.dumps(schema(), indent=2, ensure_ascii=False) + "\n"


if __name__ == "__main__":
    import sys

    sys.stdout.write(render())
