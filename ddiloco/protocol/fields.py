"""Typed reads and writes of JSON documents: the helpers every message of `ddiloco.protocol.messages` uses.

Design choices:
- A message is a dataclass; `plain` turns one (or a list/dict of them) into JSON values field by field, in
  field order, so the JSON's order is the dataclass's.
- `Fields` reads one JSON object with types checked; every error is a ValueError naming the document and the
  field. Numbers are kept as written (an int stays an int), so a document read and written back is the same
  JSON; a bool is never a number.
"""

from __future__ import annotations

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
        JSON types its annotation admits (`_KINDS`), in field order; an absent field takes the dataclass
        default when `defaults` (else it is missing)."""
        values = dict(given)
        for f in fields(cls):  # type: ignore[arg-type]
            if f.name in given:
                continue
            kind = _KINDS.get(str(f.type))
            if kind is None:
                raise TypeError(f"{cls.__name__}.{f.name}: a field of type {f.type} must be given to build")
            default: Any = ...
            if defaults and f.default is not MISSING:
                default = f.default
            values[f.name] = self.get(f.name, kind, default)
        return cls(**values)

    def each(self, name: str, parse: Callable[[Any, str], T], default: Any = ...) -> list[T]:
        return [parse(x, f"{self.doc}.{name}[{i}]") for i, x in enumerate(self.get(name, list, default))]
