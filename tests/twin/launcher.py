"""From resolved inputs to the exact argv a component process runs, and back from its output files.

Design choices:
- The executor input is built once per task, as the driver does (retries of a task reuse the same pod spec
  patch, hence the same executor input and output URIs).
- Deviation (documented in the package docstring): artifact URIs are absolute paths under the twin's work
  dir instead of `minio://...`. KFP's SDK uses a plain-path URI as the local path itself
  (kfp/dsl/types/artifact_types.py Artifact._get_path: `local_path = self.uri`), and the twin treats such a
  path as its own local path where the launcher's LocalPathForURI would map `minio://` to `/minio/`.
  Output parameter files live under a per-task scratch dir that stands for the pod's own `/tmp`.

Rules and their sources (KFP 2.17.0):
- backend/src/v2/driver/driver.go provisionOutputs: output artifact URIs `<root>/<task>/<uuid>/<name>`,
  output parameter files `/tmp/kfp/outputs/<name>`, executor output file `<task root>/output_metadata.json`;
  with publish_logs "true" (the driver's flag default, and PUBLISH_LOGS in the stock API server deployment)
  an extra `executor-logs` output artifact, whose URI the launcher suffixes with `-<retry index>`
  (launcher_v2.go qualifyExecutorLogsForRetry: KFP_RETRY_INDEX, else the `(N)` of the node name, else 0).
- backend/src/v2/driver/driver.go initPodSpecPatch + driver/util.go resolveContainerArgs: before the pod
  exists, the driver replaces `{{$.inputs.parameters['x']}}` in the container command and args with
  pbValueToString of the *driver's* executor input (no defaults; a missing one is an error), skips args that
  contain "$.outputs", and expands IfPresent clauses. `{{$}}` is left alone.
- backend/src/v2/component/launcher_v2.go NewLauncherV2: command = first element, args = the rest.
- launcher_v2.go executeV2 + addDefaultParams: defaults of the component's inputs are added to a *copy* of
  the executor input, which is what `{{$}}` and the placeholders see.
- launcher_v2.go compileCmdAndArgs: in the command only `{{$}}` is replaced (the loop over placeholders
  updates a variable it never uses); in each arg `{{$}}` is replaced by the executor input JSON first, then
  every placeholder of getPlaceholders by plain substring replacement - raw values, no JSON escaping - so a
  channel placeholder embedded in a parameter value inside the JSON is resolved, and
  `{{$.pipeline_job_uuid}}` (not a placeholder) stays. getPlaceholders' error is dropped (its `err` is
  overwritten), which then means *no* placeholder replacement at all (e.g. a null parameter value).
  Go iterates the placeholder map in random order; the twin uses sorted order.
- launcher_v2.go getExecutorOutputFile + collectOutputParameters: parameters the executor output file does
  not carry are read from their output files (metadata.TextToPbValue); a missing file fails the task.
- launcher_v2.go uploadOutputArtifacts + mergeRuntimeArtifacts: an output artifact the executor output
  reports (the SDK writes every output artifact's uri and metadata there: kfp/dsl/executor.py
  write_executor_output) takes its non-empty `uri`, and its metadata fields are merged over the provisioned
  ones, key by key (executor-logs excepted); then the artifact's local path is uploaded to that URI, and
  objectstore.Config.KeyFromURI refuses a URI outside the pipeline root's bucket and prefix ("URI %q does
  not have expected bucket prefix %q"), which fails the task. So a component cannot point its output
  artifact at an object elsewhere in the store; what it writes to `.path` is what the URI holds. The
  artifact is recorded in MLMD with its type's schema title (getArtifactSchema: `system.Model`, ...) and its
  metadata fields as custom properties (metadata/converter.go toMLMDArtifact -> StructValueToMLMDValue), where
  a null field is an error ("unknown/unsupported value type", a TODO there) that fails the task.
"""

from __future__ import annotations

import json
import re
import uuid
from pathlib import Path
from typing import Any

from tests.twin.gofmt import format_f, protojson, text_to_pb, to_value

_INPUT_PARAM = re.compile(r"\{\{\$\.inputs\.parameters\['(.+?)'\]\}\}")


class LauncherError(RuntimeError):
    pass


def provision_outputs(
    component: dict[str, Any], pipeline_root: Path, task_name: str, pod_tmp: Path, publish_logs: bool = True
) -> dict:
    """driver.provisionOutputs (with local paths, see the module docstring); publish_logs adds the launcher's
    `executor-logs` output artifact, as the driver's default `--publish_logs true` does."""
    out_defs = dict(component.get("outputDefinitions", {}))
    if publish_logs:
        arts = {
            **out_defs.get("artifacts", {}),
            "executor-logs": {"artifactType": {"schemaTitle": "system.Artifact"}},
        }
        out_defs["artifacts"] = arts
    task_root = f"{str(pipeline_root).rstrip('/')}/{task_name}/{uuid.uuid4()}"
    outputs: dict[str, Any] = {}
    artifacts = {
        name: {
            "artifacts": [
                {
                    "name": name,
                    "uri": f"{task_root}/{name}",
                    "type": spec.get("artifactType", {}),
                    **({"metadata": spec["metadata"]} if spec.get("metadata") else {}),
                }
            ]
        }
        for name, spec in out_defs.get("artifacts", {}).items()
    }
    if artifacts:
        outputs["artifacts"] = artifacts
    params = {
        name: {"outputFile": f"{pod_tmp}/kfp/outputs/{name}"} for name in out_defs.get("parameters", {})
    }
    if params:
        outputs["parameters"] = params
    outputs["outputFile"] = f"{task_root}/output_metadata.json"
    return outputs


def with_retry_index(ex_input: dict, retry_index: str) -> dict:
    """launcher_v2.go qualifyExecutorLogsURI: this attempt's executor-logs URI ends in `-<retry index>`."""
    logs = ex_input.get("outputs", {}).get("artifacts", {}).get("executor-logs")
    if not logs or len(logs.get("artifacts", [])) != 1:
        return ex_input
    out = json.loads(json.dumps(ex_input))
    art = out["outputs"]["artifacts"]["executor-logs"]["artifacts"][0]
    if not art["uri"].endswith(f"-{retry_index}"):
        art["uri"] += f"-{retry_index}"
    return out


def executor_input(parameter_values: dict[str, Any], artifacts: dict[str, Any], outputs: dict) -> dict:
    inputs: dict[str, Any] = {}
    if parameter_values:
        inputs["parameterValues"] = parameter_values
    if artifacts:
        inputs["artifacts"] = artifacts
    return {"inputs": inputs, "outputs": outputs}


def with_defaults(ex_input: dict, component: dict[str, Any]) -> dict:
    """launcher_v2.go addDefaultParams (on a copy)."""
    out = json.loads(json.dumps(ex_input))
    values = out.setdefault("inputs", {}).setdefault("parameterValues", {})
    for name, spec in component.get("inputDefinitions", {}).get("parameters", {}).items():
        if "defaultValue" in spec and name not in values:
            values[name] = to_value(spec["defaultValue"])
    return out


def _go_json(v: Any) -> str:
    """Go encoding/json of a value: sorted keys, compact, HTML characters escaped."""
    text = protojson(v, sort_keys=True)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _pb_value_to_string(v: Any) -> str:
    """driver/util.go pbValueToString."""
    if isinstance(v, str):
        return v
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return str(int(v)) if v.is_integer() else format_f(v)
    if v is None:
        return ""
    return _go_json(v)


def driver_resolve_args(args: list[str], ex_input: dict) -> list[str]:
    """driver/util.go resolveContainerArgs (used by initPodSpecPatch on command and on args)."""
    values = ex_input.get("inputs", {}).get("parameterValues", {})
    out: list[str] = []
    for arg in args:
        if "$.outputs" in arg:
            out.append(arg)
        elif arg.strip().startswith('{"IfPresent":'):
            clause = json.loads(arg)["IfPresent"]
            present = values.get(clause["InputName"]) is not None
            chosen = clause.get("Then") if present else clause.get("Else")
            items = [] if chosen is None else [chosen] if isinstance(chosen, str) else chosen
            out.extend(_driver_replace(str(i), values) for i in items)
        else:
            out.append(_driver_replace(arg, values))
    return out


def _driver_replace(arg: str, values: dict[str, Any]) -> str:
    def one(m: re.Match[str]) -> str:
        if m.group(1) not in values:
            raise LauncherError(
                f"failed to resolve input parameters: parameter {m.group(1)!r} not found in executor input"
            )
        return _pb_value_to_string(values[m.group(1)])

    return _INPUT_PARAM.sub(one, arg)


def placeholders(ex_input: dict) -> dict[str, str] | None:
    """launcher_v2.go getPlaceholders; None where Go returns an error."""
    out: dict[str, str] = {}
    for name, lst in ex_input.get("inputs", {}).get("artifacts", {}).items():
        if lst.get("artifacts"):
            a = lst["artifacts"][0]
            out[f"{{{{$.inputs.artifacts['{name}'].uri}}}}"] = a["uri"]
            out[f"{{{{$.inputs.artifacts['{name}'].path}}}}"] = a["uri"]  # local path: see module docstring
    for name, lst in ex_input.get("outputs", {}).get("artifacts", {}).items():
        if lst.get("artifacts"):
            a = lst["artifacts"][0]
            out[f"{{{{$.outputs.artifacts['{name}'].uri}}}}"] = a["uri"]
            out[f"{{{{$.outputs.artifacts['{name}'].path}}}}"] = a["uri"]
    for name, v in ex_input.get("inputs", {}).get("parameterValues", {}).items():
        key = f"{{{{$.inputs.parameters['{name}']}}}}"
        if isinstance(v, str):
            out[key] = v
        elif isinstance(v, bool):
            out[key] = "true" if v else "false"
        elif isinstance(v, float):
            out[key] = format_f(v)
        elif isinstance(v, list | dict):
            out[key] = _go_json(v)
        else:
            return None  # "unknown PipelineSpec Value type" (a null value)
    for name, p in ex_input.get("outputs", {}).get("parameters", {}).items():
        out[f"{{{{$.outputs.parameters['{name}'].output_file}}}}"] = p["outputFile"]
    return out


def compile_cmd_and_args(ex_input_with_defaults: dict, cmd: str, args: list[str]) -> list[str]:
    """launcher_v2.go compileCmdAndArgs: the argv the launcher execs."""
    as_json = protojson(ex_input_with_defaults)
    repl = placeholders(ex_input_with_defaults) or {}
    compiled = []
    for arg in args:
        arg = arg.replace("{{$}}", as_json)
        for key in sorted(repl):
            arg = arg.replace(key, repl[key])
        compiled.append(arg)
    return [cmd.replace("{{$}}", as_json), *compiled]


def collect_outputs(
    ex_input: dict, component: dict[str, Any], pipeline_root: str | Path | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """getExecutorOutputFile + collectOutputParameters + uploadOutputArtifacts (the artifacts the executor
    reported merged over the provisioned ones; a URI outside `pipeline_root` fails, as KeyFromURI does)."""
    path = Path(ex_input["outputs"]["outputFile"])
    executor_output: dict[str, Any] = {}
    if path.exists():
        try:
            executor_output = json.loads(path.read_text() or "{}")
        except ValueError as e:
            raise LauncherError(f"failed to unmarshall ExecutorOutput in file {str(path)!r}: {e}") from None
    params = {k: to_value(v) for k, v in (executor_output.get("parameterValues") or {}).items()}
    defs = component.get("outputDefinitions", {}).get("parameters", {})
    for name, p in ex_input["outputs"].get("parameters", {}).items():
        if name in params:
            continue
        ptype = defs[name].get("parameterType", "STRING")
        msg = f"failed to read output parameter name={name!r} type={ptype!r} path={p['outputFile']!r}"
        try:
            params[name] = text_to_pb(Path(p["outputFile"]).read_text(), ptype)
        except (OSError, ValueError) as e:
            raise LauncherError(f"{msg}: {e}") from None
    artifacts = {}
    for name, lst in ex_input["outputs"].get("artifacts", {}).items():
        art = dict(lst["artifacts"][0])
        reports = (executor_output.get("artifacts") or {}).get(name, {}).get("artifacts", [])
        for reported in reports[:1] if name != "executor-logs" else []:
            art["uri"] = reported.get("uri") or art["uri"]
            art["metadata"] = {**(art.get("metadata") or {}), **(reported.get("metadata") or {})}
        prefix = str(pipeline_root).rstrip("/") if pipeline_root is not None else None
        if prefix is not None and not art["uri"].startswith(prefix):
            raise LauncherError(
                f"failed to upload output artifact {name!r}: URI {art['uri']!r} does not have expected "
                f"bucket prefix {prefix!r}"
            )
        nulls = sorted(k for k, v in (art.get("metadata") or {}).items() if v is None)
        if nulls:
            raise LauncherError(
                f"unable to produce MLMD artifact for output {name!r}: failed to convert RuntimeArtifact to "
                f"MLMD artifact: unknown/unsupported value type *structpb.Value_NullValue (field {nulls[0]!r})"
            )
        artifacts[name] = art
    return params, artifacts
