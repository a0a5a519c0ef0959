"""The KFP driver's input resolution: what a task's executor (or sub-DAG) receives as parameter values.

Design choices:
- MLMD is replaced by the twin's own state: a `Scope` answers "the parent DAG's input parameters" and "the
  output parameter of producer task P in this DAG" (for an iteration, the producer of the same iteration, as
  the driver's InferIndexedTaskName does).
- Values are structpb-like (gofmt.to_value): a resolution error is a `ResolveError` whose message is the
  driver's, so a failing task reads as it would in the KFP UI.

Rules and their sources (KFP 2.17.0, backend/src/v2/driver/resolve.go unless said otherwise):
- resolveInputParameter, RuntimeValue constant: `{{$.workspace_path}}` is replaced *inside* the string
  (strings.ReplaceAll, component.WorkspaceMountPath "/kfp-workspace"); the other special placeholders are
  replaced only when they are the *whole* constant (`switch valStr`): pipeline_job_name (run display name),
  pipeline_job_resource_name (run name = Argo workflow name), pipeline_job_uuid (run id), pipeline_task_name,
  pipeline_task_uuid (parent DAG execution id), pipeline_job_create_time_utc, pipeline_job_schedule_time_utc.
  Anything else - including `s3://b/{{$.pipeline_job_uuid}}` - is passed through unchanged.
- resolveInputParameter, ComponentInputParameter: the parent DAG's parameter; a null value is
  ErrResolvedParameterNull, which resolveInputs skips for an optional component input and fails otherwise.
- resolveInputParameter, TaskOutputParameter: resolveUpstreamParameters; a DAG producer is followed through
  its `dag.outputs.parameters[*].valueFromParameter` (GetProducerTask); a ParallelFor producer (Collected) is
  not modelled.
- resolveInputParameter, TaskFinalStatus: {state, pipelineTaskName, pipelineJobResourceName, error: {}} of the
  task's first dependent task; state is the MLMD execution state (COMPLETE / FAILED).
- resolveInputs: every task input is resolved, including `pipelinechannel--*` inputs that are not component
  inputs; optional component inputs without a value are *not* passed (the launcher adds their defaults,
  launcher_v2.go addDefaultParams); a DAG driver passes defaults (or null) for omitted optional inputs.
- resolveInputs, handleParamTypeValidationAndConversion: a non-string value for a STRING input becomes its
  text (metadata.PbValueToText); a value of the wrong kind for other types is "type mismatch"; null is an
  error
  unless the driver set it; the iterator skips its item input, an iteration skips the items input.
- resolveInputs, iteration driver: the iteration's parameters are the loop's, minus the items input, plus
  `itemInput` = items[index] (getItems: a list, or a JSON string holding a list; driver/util.go).
- driver/dag.go DAG: the iterator's items come from the `items.inputParameter` input or from `items.raw`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol

from tests.twin.gofmt import pb_to_text, to_value

WORKSPACE_MOUNT_PATH = "/kfp-workspace"


class ResolveError(ValueError):
    pass


class NullParameter(ResolveError):
    """driver.ErrResolvedParameterNull."""


@dataclass(frozen=True)
class RunContext:
    run_id: str
    run_name: str
    run_display_name: str
    create_time_utc: str
    schedule_time_utc: str = ""


class Scope(Protocol):
    """The parent DAG of a task, as the driver sees it through MLMD."""

    inputs: dict[str, Any]
    execution_id: int

    def task_output(self, producer: str, key: str) -> Any: ...

    def task_final_status(self, producer: str) -> dict[str, Any]: ...


def special_constant(val: Any, run: RunContext, task_name: str, execution_id: int) -> Any:
    """resolveInputParameter's RuntimeValue/Constant branch."""
    s = val if isinstance(val, str) else ""  # val.GetStringValue() of a non-string is ""
    if "{{$.workspace_path}}" in s:
        return s.replace("{{$.workspace_path}}", WORKSPACE_MOUNT_PATH)
    whole = {
        "{{$.pipeline_job_name}}": run.run_display_name,
        "{{$.pipeline_job_resource_name}}": run.run_name,
        "{{$.pipeline_job_uuid}}": run.run_id,
        "{{$.pipeline_task_name}}": task_name,
        "{{$.pipeline_task_uuid}}": str(execution_id),
        "{{$.pipeline_job_create_time_utc}}": run.create_time_utc,
        "{{$.pipeline_job_schedule_time_utc}}": run.schedule_time_utc,
    }
    return whole.get(s, val)


def resolve_parameter(spec: dict[str, Any], scope: Scope, run: RunContext, task_name: str) -> Any:
    """driver.resolveInputParameter."""
    if "componentInputParameter" in spec:
        name = spec["componentInputParameter"]
        if not name:
            raise ResolveError("empty component input")
        if name not in scope.inputs:
            raise ResolveError(f"parent DAG does not have input parameter {name}")
        if scope.inputs[name] is None:
            raise NullParameter(f"the resolved input parameter is null: {name}")
        return scope.inputs[name]
    if "taskOutputParameter" in spec:
        t = spec["taskOutputParameter"]
        if not t.get("producerTask"):
            raise ResolveError("producerTaskName is empty")
        if not t.get("outputParameterKey"):
            raise ResolveError("output parameter key is empty")
        return scope.task_output(t["producerTask"], t["outputParameterKey"])
    if "runtimeValue" in spec:
        rv = spec["runtimeValue"]
        if "constant" not in rv:
            raise ResolveError(f"param runtime value spec {sorted(rv)} not implemented")
        return special_constant(to_value(rv["constant"]), run, task_name, scope.execution_id)
    if "taskFinalStatus" in spec:
        return scope.task_final_status(spec["taskFinalStatus"]["producerTask"])
    raise ResolveError(f"parameter spec of type {sorted(spec)} not implemented yet")


_KINDS = {str: "string", float: "number", bool: "bool", list: "list", dict: "struct"}
_ACCEPTS = {
    "number": ("NUMBER_DOUBLE", "NUMBER_INTEGER"),
    "bool": ("BOOLEAN",),
    "list": ("LIST",),
    "struct": ("STRUCT", "TASK_FINAL_STATUS", "TASK_CONFIG"),
}


def _validate(
    values: dict[str, Any], defs: dict[str, Any], task: dict[str, Any], iteration: bool, set_nil: set[str]
) -> None:
    """handleParamTypeValidationAndConversion (values are converted in place)."""
    iterator = task.get("parameterIterator")
    for name, spec in defs.items():
        if iterator is not None:
            if not iteration and iterator.get("itemInput") == name:
                continue
            if iteration and iterator.get("items", {}).get("inputParameter") == name:
                continue
        has = name in values
        if not has and not spec.get("isOptional"):
            if "defaultValue" not in spec:
                raise ResolveError(
                    f"neither value nor default value provided for non-optional parameter {name!r}"
                )
        elif not has:
            continue
        value, ptype = values.get(name), spec.get("parameterType", "")
        if ptype == "STRING":
            if not isinstance(value, str) and name not in set_nil:
                values[name] = pb_to_text(value)
            continue
        if value is None:
            if name in set_nil:
                continue
            raise ResolveError(f"got null for input parameter {name!r}")
        kind = _KINDS.get(type(value), "unknown")
        if kind == "string" or ptype not in _ACCEPTS.get(kind, ()):
            raise ResolveError(f"input parameter {name!r} type mismatch: expect {ptype}, got {kind}")


def resolve_inputs(
    task: dict[str, Any],
    component: dict[str, Any],
    scope: Scope,
    run: RunContext,
    task_name: str,
    *,
    dag_driver: bool = False,
) -> dict[str, Any]:
    """driver.resolveInputs for a container task (dag_driver=False) or a sub-DAG / loop task."""
    defs = component.get("inputDefinitions", {}).get("parameters", {})
    task_params = task.get("inputs", {}).get("parameters", {})
    values: dict[str, Any] = {}
    set_nil: set[str] = set()
    if dag_driver:
        for name, spec in defs.items():
            if name not in task_params and spec.get("isOptional"):
                if "defaultValue" in spec:
                    values[name] = to_value(spec["defaultValue"])
                else:
                    values[name] = None
                    set_nil.add(name)
    for name, spec in task_params.items():
        if defs.get(name, {}).get("parameterType") == "TASK_CONFIG":
            continue
        try:
            v = resolve_parameter(spec, scope, run, task_name)
        except NullParameter:
            if defs.get(name, {}).get("isOptional"):
                continue
            raise
        literals = defs.get(name, {}).get("literals")
        if literals and v not in [to_value(x) for x in literals]:
            raise ResolveError(f"validating parameter {name!r}: value {v!r} is not one of {literals}")
        values[name] = v
    _validate(values, defs, task, False, set_nil)
    return values


def iterator_items(task: dict[str, Any], loop_inputs: dict[str, Any]) -> list[Any]:
    """driver/dag.go DAG: the items a ParallelFor iterates over."""
    items_spec = task["parameterIterator"].get("items", {})
    if "raw" in items_spec:
        return _items(to_value(json.loads(items_spec["raw"])))
    name = items_spec.get("inputParameter", "")
    if name not in loop_inputs:
        raise ResolveError(
            f"iterating on item input {task['parameterIterator'].get('itemInput')!r} failed: "
            "cannot find input parameter"
        )
    return _items(loop_inputs[name])


def _items(value: Any) -> list[Any]:
    """driver/util.go getItems."""
    if isinstance(value, list):
        return value
    if isinstance(value, str):
        parsed = to_value(json.loads(value))
        return parsed if isinstance(parsed, list) else []
    raise ResolveError(f"value of type {type(value).__name__} cannot be iterated")


def iteration_inputs(
    task: dict[str, Any], component: dict[str, Any], loop_inputs: dict[str, Any], items: list[Any], index: int
) -> dict[str, Any]:
    """resolveInputs for an iteration driver (iterationIndex != nil)."""
    iterator = task["parameterIterator"]
    values = dict(loop_inputs)
    items_input = iterator.get("items", {}).get("inputParameter") or iterator.get("itemInput")
    values.pop(items_input, None)
    values[iterator["itemInput"]] = items[index]
    _validate(values, component.get("inputDefinitions", {}).get("parameters", {}), task, True, set())
    return values


def final_status(state: str, producer: str, run: RunContext) -> dict[str, Any]:
    """The PipelineTaskFinalStatus struct (protojson field names)."""
    return {
        "state": state,
        "pipelineTaskName": producer,
        "pipelineJobResourceName": run.run_name,
        "error": {},
    }


def dag_output(component: dict[str, Any], key: str) -> tuple[str, str]:
    """A DAG's output parameter -> (producer subtask, its output key) (GetProducerTask)."""
    spec = component.get("dag", {}).get("outputs", {}).get("parameters", {}).get(key)
    if spec is None or "valueFromParameter" not in spec:
        raise ResolveError(
            f"DAG output parameter {key!r} is not a valueFromParameter (oneOf is not modelled)"
        )
    vfp = spec["valueFromParameter"]
    return vfp["producerSubtask"], vfp["outputParameterKey"]
