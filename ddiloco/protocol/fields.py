"""Typed reads and writes of JSON documents: the helpers every message of `ddiloco.protocol.messages` uses.

Design choices:
- A message is a dataclass; `plain` turns one (or a list/dict of them) into JSON values field by field, in
  field order, so the JSON's order is the dataclass's.
- `Fields` reads one JSON object with types checked; every error is a ValueError naming the document and the
  field. Numbers are kept as written (an int stays an int), so a document read and written back is the same
  JSON; a bool is never a number.
- A field whose annotation is built of JSON types alone (int, float, str, bool, None, Any, list[...],
  dict[str, ...]) is read and checked through it; a field holding a message is given to `build`.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import MISSING, fields, is_dataclass
from typing import Any, TypeVar

T = TypeVar("T")

_NONE = type(None)
_KINDS: dict[str, type | tuple[type, ...]] = {
    "int": int,
    "float": (int, float),
    "str": str,
    "bool": bool,
    "int | None": (int, _NONE),
    "float | None": (int, float, _NONE),
    "str | None": (str, _NONE),
}
"""The JSON types a field's annotation (a string: the modules use postponed annotations) admits."""


Check = Callable[[Any], bool]


def json_check(hint: Any) -> Check | None:
    """Whether a JSON value is of type `hint` (int, float, str, bool, None, Any, list[X], dict[str, X] and
    unions of them; an int is a float, a bool is no number); None for a hint of any other type."""
    scalar = _SCALARS.get(hint)
    if scalar is not None or hint is Any:
        return scalar or (lambda v: True)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        checks = [json_check(a) for a in args]
        if any(c is None for c in checks):
            return None
        return lambda v: any(c(v) for c in checks)  # type: ignore[misc]
    item = json_check(args[-1]) if args else None
    if item is None:
        return None
    if origin is list:
        return lambda v: isinstance(v, list) and all(item(x) for x in v)
    if origin is dict and args[0] is str:
        return lambda v: isinstance(v, Mapping) and all(isinstance(k, str) and item(x) for k, x in v.items())
    return None


_SCALARS: dict[Any, Check] = {
    type(None): lambda v: v is None,
    bool: lambda v: isinstance(v, bool),
    int: lambda v: isinstance(v, int) and not isinstance(v, bool),
    float: lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    str: lambda v: isinstance(v, str),
}


def plain(v: Any) -> Any:
    """A dataclass document (or a list/dict of them) as JSON values."""
    if is_dataclass(v) and not isinstance(v, type):
        return {f.name: plain(getattr(v, f.name)) for f in fields(v)}
    if isinstance(v, list):
        return [plain(x) for x in v]
    if isinstance(v, Mapping):
        return {k: plain(x) for k, x in v.items()}
    return v


class Fields:
    """Typed reads of one JSON object; every error names `doc` and the field. Numbers are kept as written
    (an int stays an int), so a document read and written back is the same JSON."""

    def __init__(self, obj: Any, doc: str) -> None:
        if not isinstance(obj, Mapping):
            raise ValueError(f"{doc}: expected a JSON object, got {type(obj).__name__}")
        self.obj, self.doc = obj, doc

    def bad(self, name: str, what: str) -> ValueError:
        return ValueError(f"{self.doc}: field {name!r} {what}")

    def get(self, name: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
        if name not in self.obj and default is not ...:
            return default
        if name not in self.obj:
            raise self.bad(name, "is missing")
        v = self.obj[name]
        if not isinstance(v, kind) or (isinstance(v, bool) and kind is not bool):
            raise self.bad(name, f"is not {getattr(kind, '__name__', 'a number')}: {str(v)[:40]!r}")
        return v

    def integer(self, name: str) -> int:
        return self.get(name, int)

    def number(self, name: str) -> float:
        return self.get(name, (int, float))

    def mapping(self, name: str, kind: type | tuple[type, ...], default: Any = ...) -> dict[str, Any]:
        """An object whose values are all of `kind` (a bool is no number here)."""
        v = self.get(name, Mapping, default)
        if any(not isinstance(x, kind) or isinstance(x, bool) for x in v.values()):
            raise self.bad(name, "holds a value of the wrong type")
        return dict(v)

    def build(self, cls: type[T], *, defaults: bool = True, **given: Any) -> T:
        """The dataclass `cls` from this object: the fields in `given` as given, every other one read with the
        JSON types its annotation admits (`_KINDS`, else `json_check`), in field order; an absent field takes
        the dataclass default when `defaults` (else it is missing)."""
        values = dict(given)
        hints: dict[str, Any] | None = None
        for f in fields(cls):  # type: ignore[arg-type]
            if f.name in given:
                continue
            default: Any = ...
            if defaults and f.default is not MISSING:
                default = f.default
            elif defaults and f.default_factory is not MISSING:
                default = f.default_factory()
            kind = _KINDS.get(str(f.type))
            if kind is not None:
                values[f.name] = self.get(f.name, kind, default)
                continue
            hints = hints or typing.get_type_hints(cls)
            check = json_check(hints[f.name])
            if check is None:
                raise TypeError(f"{cls.__name__}.{f.name}: a field of type {f.type} must be given to build")
            values[f.name] = self.checked(f.name, check, f.type, default)
        return cls(**values)

    def checked(self, name: str, check: Check, what: Any, default: Any = ...) -> Any:
        """Field `name` as it is, when `check` admits it (`what`: the type the error names)."""
        if name not in self.obj and default is not ...:
            return default
        if name not in self.obj:
            raise self.bad(name, "is missing")
        v = self.obj[name]
        if not check(v):
            raise self.bad(name, f"is not {what}: {str(v)[:40]!r}")
        return v

    def each(self, name: str, parse: Callable[[Any, str], T], default: Any = ...) -> list[T]:
        return [parse(x, f"{self.doc}.{name}[{i}]") for i, x in enumerate(self.get(name, list, default))]
