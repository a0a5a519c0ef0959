"""Setting a dataclass tree from dicts (JSON, YAML) and from `a.b.c=value` overrides, with type coercion.

Design choices:
- Generic over any tree of dataclasses: this module knows no section of the run config, so the schema
  (`ddiloco.config.run`) and the recipes (`ddiloco.config.recipes`) both build on it without importing each other.
- The field's type hint decides the coercion; a value that does not fit is a `ConfigError` naming the key.
- An optional section that is null (`diloco.grace: null`) is turned off; setting a key inside a section that
  is off turns it on with the section's defaults.
- Unknown keys get a "did you mean" suggestion and the list of valid keys.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import types
import typing
from typing import Any

import yaml

from ddiloco.errors import ConfigError


def apply_override(cfg: Any, item: str) -> None:
    """Apply one `a.b.c=value` override to the dataclass tree `cfg`; the value is parsed as a YAML scalar
    (`null`, `true`, `3`, `1e-3`)."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like section.key=value, e.g. diloco.quorum=2")
    key, raw = item.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    parts = key.strip().split(".")
    nested: Any = value
    for part in reversed(parts):
        nested = {part: nested}
    apply_dict(cfg, nested)


def apply_dict(obj: Any, values: dict[str, Any], path: str = "") -> None:
    """Recursively set dataclass fields from a dict, checking names and types."""
    fields = {f.name: f for f in dataclasses.fields(obj)}
    hints = typing.get_type_hints(type(obj))
    for key, value in values.items():
        full = f"{path}{key}"
        if key not in fields:
            close = difflib.get_close_matches(key, list(fields), n=1)
            hint = f"; did you mean {path + close[0]!r}?" if close else ""
            raise ConfigError(
                f"unknown config key {full!r}{hint} (valid keys: {', '.join(path + f for f in fields)})"
            )
        hint_t = hints[key]
        sub_t = _dataclass_type(hint_t)
        if sub_t is not None:
            if value is None:
                if not _is_optional(hint_t):
                    raise ConfigError(f"{full} cannot be null")
                setattr(obj, key, None)
                continue
            if not isinstance(value, dict):
                raise ConfigError(f"{full} is a section; give it as a mapping or set {full}.<key>=value")
            current = getattr(obj, key)
            if current is None:
                current = sub_t()
                setattr(obj, key, current)
            apply_dict(current, value, full + ".")
        else:
            setattr(obj, key, _coerce(value, hint_t, full))


def _dataclass_type(t: Any) -> type | None:
    for cand in typing.get_args(t) or (t,):
        if dataclasses.is_dataclass(cand):
            return cand
    return None


def _is_optional(t: Any) -> bool:
    return type(None) in typing.get_args(t)


def _coerce(value: Any, t: Any, name: str) -> Any:
    args = typing.get_args(t)
    if isinstance(t, types.UnionType) or typing.get_origin(t) is typing.Union:
        if value is None and type(None) in args:
            return None
        for cand in args:
            if cand is type(None):
                continue
            try:
                return _coerce(value, cand, name)
            except ConfigError:
                pass
        raise ConfigError(f"{name}={value!r} has the wrong type; expected {t}")
    if t is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{name}={value!r} must be true or false")
    if t is int:
        if isinstance(value, bool) or not isinstance(value, int | float) or int(value) != value:
            raise ConfigError(f"{name}={value!r} must be an integer")
        return int(value)
    if t is float:
        if isinstance(value, str):  # YAML 1.1 reads "1e-3" as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{name}={value!r} must be a number")
        return float(value)
    if t is str:
        if not isinstance(value, str):
            raise ConfigError(f"{name}={value!r} must be a string")
        return value
    if typing.get_origin(t) is list:
        if not isinstance(value, list):
            raise ConfigError(f"{name}={value!r} must be a list")
        return copy.deepcopy(value)
    return copy.deepcopy(value)
