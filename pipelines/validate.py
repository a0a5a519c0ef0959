"""Run-time parameters checked where they are given (`ddiloco pipeline compile | submit | schedule create`),
not minutes into a run: each value against its parameter's type, and the run config the prepare step would
build from them (recipe, overrides, learners, quorum, token budget, chaos, model, corpus) by the prepare step's
own code (`ddiloco.components.runtime.check_run`, which a run's first step calls too, for runs started from
the KFP UI): an unknown key is refused with a did-you-mean. kfp is not imported here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ddiloco.components.runtime import check_run

from ddiloco.errors import ConfigError

KINDS: dict[str, tuple[type, ...]] = {
    "NUMBER_INTEGER": (int,),
    "NUMBER_DOUBLE": (int, float),
    "BOOLEAN": (bool,),
    "STRING": (str,),
    "LIST": (list,),
    "STRUCT": (dict,),
}
"""A compiled parameter's `parameterType` -> the Python values it takes."""
_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string", list: "a list"}


def kind_of(default: Any) -> tuple[type, ...]:
    """The Python values a parameter with this (Python) default takes."""
    if isinstance(default, bool):
        return (bool,)
    return (int, float) if isinstance(default, float) else (type(default),)


def check_types(values: Mapping[str, Any], kinds: Mapping[str, tuple[type, ...]]) -> None:
    """Each value fits its parameter's kind (a bool is no integer)."""
    for name, value in values.items():
        kind = kinds.get(name)
        if kind is None:
            continue
        fits = isinstance(value, kind) and not (isinstance(value, bool) and bool not in kind)
        if not fits:
            want = _NAMES.get(kind[-1], "a mapping")
            raise ConfigError(f"parameter {name}={value!r} must be {want}")


def _prepare_constants(ir: Mapping[str, Any]) -> dict[str, Any]:
    """The compile-time constants a package passes to its prepare step (max_learners, learner_ranks)."""
    for comp in [ir.get("root", {}), *ir.get("components", {}).values()]:
        for task in comp.get("dag", {}).get("tasks", {}).values():
            if task.get("componentRef", {}).get("name") == "comp-prepare":
                params = task.get("inputs", {}).get("parameters", {})
                return {k: v["runtimeValue"]["constant"] for k, v in params.items() if "runtimeValue" in v}
    return {}


def check_package(ir: Mapping[str, Any], params: Mapping[str, Any]) -> None:
    """`params` (given at submit or schedule time) over the defaults of the compiled pipeline `ir`."""
    spec = ir.get("root", {}).get("inputDefinitions", {}).get("parameters", {})
    kinds = {k: KINDS[v["parameterType"]] for k, v in spec.items() if v.get("parameterType") in KINDS}
    check_types(params, kinds)
    values = {k: v.get("defaultValue") for k, v in spec.items()} | dict(params)
    missing = [k for k, v in values.items() if v is None]
    if "recipe" in values and not missing:
        constants = _prepare_constants(ir)
        check_run(values, int(constants.get("max_learners", 1)), int(constants.get("learner_ranks", 1)))
