"""How the Go side of KFP and Argo prints and parses values: the twin must produce the same strings.

Design choices:
- Values are held as protobuf `structpb.Value`s hold them: JSON types, every number a float (`to_value`).

Rules and their sources:
- `fmt_v`: Go `fmt.Sprintf("%v", x)` of a float64 is `strconv.FormatFloat(x, 'g', -1, 64)`: shortest digits,
  exponent form when the exponent is < -4 or >= 6 (Go strconv/ftoa.go: "if precision was the shortest
  possible, use precision 6 for this decision"; not in the mirrors, Go's standard library). Used by Argo's
  `AnyStringPtr` (pkg/apis/workflow/v1alpha1/anystring.go ParseAnyString) on KFP's backoff factor
  (backend/src/v2/compiler/argocompiler/container.go getTaskRetryParametersWithValues):
  2.0 -> "2", 1.5 -> "1.5".
- `format_f`: `strconv.FormatFloat(x, 'f', -1, 64)`: number parameters in placeholders
  (backend/src/v2/component/launcher_v2.go getPlaceholders) and `metadata.PbValueToText`
  (backend/src/v2/metadata/converter.go): 8.0 -> "8", 0.5 -> "0.5", never an exponent.
- `pb_to_text` / `text_to_pb`: backend/src/v2/metadata/converter.go PbValueToText, TextToPbValue.
- `protojson`: `protojson.Marshal` of an ExecutorInput (launcher_v2.go compileCmdAndArgs): compact JSON, raw
  UTF-8, integral numbers without ".0". (protojson's key order and its randomised whitespace are not copied.)
- `parse_duration`: Argo `wfv1.ParseStringToDuration` (pkg/apis/workflow/v1alpha1/utils.go): an integer is
  seconds, anything else Go `time.ParseDuration`.
- `intstr_int`: Argo `util/intstr/parametrizable.go Int`: a string IntOrString must be `strconv.Atoi`-able,
  else "value '<s>' cannot be resolved to an int".
"""

from __future__ import annotations

import json
import re
from decimal import Decimal
from typing import Any


def to_value(v: Any) -> Any:
    """A JSON-like value as a structpb.Value holds it: ints become floats (bools stay bools)."""
    if isinstance(v, bool) or v is None or isinstance(v, str | float):
        return v
    if isinstance(v, int):
        return float(v)
    if isinstance(v, dict):
        return {str(k): to_value(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [to_value(x) for x in v]
    raise TypeError(f"not a protobuf Value: {v!r} ({type(v).__name__})")


def _digits(x: float) -> tuple[str, int]:
    """Shortest round-trip digits of |x| and the decimal exponent of the first digit."""
    sign, digits, exp = Decimal(repr(abs(x))).normalize().as_tuple()
    ds = "".join(map(str, digits))
    return ds, exp + len(ds) - 1  # type: ignore[operator]


def format_f(x: float) -> str:
    """Go strconv.FormatFloat(x, 'f', -1, 64)."""
    if x == 0:
        return "0"
    return format(Decimal(repr(x)), "f") if not float(x).is_integer() else str(int(x))


def fmt_v(x: Any) -> str:
    """Go fmt.Sprintf("%v", x) for the types KFP passes to Argo's AnyStringPtr."""
    if isinstance(x, bool):
        return "true" if x else "false"
    if isinstance(x, int):
        return str(x)
    if isinstance(x, str):
        return x
    if x == 0:
        return "0"
    ds, exp = _digits(x)
    sign = "-" if x < 0 else ""
    if exp < -4 or exp >= 6:  # shortest precision: the %e decision uses precision 6
        mant = ds[0] + ("." + ds[1:] if len(ds) > 1 else "")
        return f"{sign}{mant}e{'+' if exp >= 0 else '-'}{abs(exp):02d}"
    return sign + format_f(abs(x))


def json_number(x: float) -> int | float:
    """protojson prints an integral float64 without a fraction (exponent form only from 1e21)."""
    return int(x) if float(x).is_integer() and abs(x) < 1e21 else x


def _for_json(v: Any) -> Any:
    if isinstance(v, float):
        return json_number(v)
    if isinstance(v, dict):
        return {k: _for_json(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_for_json(x) for x in v]
    return v


def protojson(v: Any, sort_keys: bool = False) -> str:
    return json.dumps(_for_json(v), ensure_ascii=False, separators=(",", ":"), sort_keys=sort_keys)


def pb_to_text(v: Any) -> str:
    """metadata.PbValueToText."""
    if v is None:
        return ""
    if isinstance(v, str):
        return v
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return format_f(v)
    return protojson(v)  # list / struct: json.Marshal


def text_to_pb(text: str, parameter_type: str) -> Any:
    """metadata.TextToPbValue: how the launcher reads an output parameter file."""
    try:
        if parameter_type == "STRING":
            return text
        if parameter_type == "NUMBER_INTEGER":
            return float(int(text.strip(), 10))
        if parameter_type == "NUMBER_DOUBLE":
            return float(text.strip())
        if parameter_type == "BOOLEAN":
            b = text.strip()
            if b not in ("1", "t", "T", "TRUE", "true", "True", "0", "f", "F", "FALSE", "false", "False"):
                raise ValueError(f"invalid syntax {b!r}")
            return b in ("1", "t", "T", "TRUE", "true", "True")
        if parameter_type in ("LIST", "STRUCT"):
            v = to_value(json.loads(text))
            if not isinstance(v, list if parameter_type == "LIST" else dict):
                raise ValueError("unexpected type")
            return v
    except ValueError as e:
        raise ValueError(f"TextToPbValue(text={text!r}, type={parameter_type!r}) failed: {e}") from None
    raise ValueError(f"unknown parameter type {parameter_type!r}")


_GO_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_GO_DUR = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h)")


def parse_duration(s: str) -> float:
    """Seconds of an Argo duration string (wfv1.ParseStringToDuration)."""
    if re.fullmatch(r"[+-]?\d+", s):  # strconv.Atoi: seconds
        return float(int(s))
    body, sign = s, 1.0
    if body[:1] in "+-" and body:
        sign, body = (-1.0 if body[0] == "-" else 1.0), body[1:]
    if body == "0":
        return 0.0
    pos, total = 0, 0.0
    for m in _GO_DUR.finditer(body):
        if m.start() != pos:
            break
        total += float(m.group(1)) * _GO_UNITS[m.group(2)]
        pos = m.end()
    if not body or pos != len(body):
        raise ValueError(f'unable to parse {s} as a duration: time: invalid duration "{s}"')
    return sign * total


def intstr_int(v: Any) -> int | None:
    """Argo util/intstr Int: None stays None, an int is itself, a string must parse as an int."""
    if v is None:
        return None
    if isinstance(v, bool):
        raise ValueError(f"value '{v}' cannot be resolved to an int")
    if isinstance(v, int):
        return v
    if not re.fullmatch(r"[+-]?\d+", str(v)):
        raise ValueError(f"value '{v}' cannot be resolved to an int")
    return int(str(v), 10)


def intstr_int_value(v: Any) -> int:
    """k8s IntOrString.IntValue(): a string that does not parse is 0."""
    try:
        return intstr_int(v) or 0
    except ValueError:
        return 0


def proto_duration_seconds(s: str) -> int:
    """`.Seconds` of a protobuf Duration in its JSON form ("10s", "1.5s" -> 1)."""
    if not s.endswith("s"):
        raise ValueError(f"bad protobuf Duration {s!r}")
    return int(Decimal(s[:-1]))
