"""The compiled pipeline: KFP IR (a PipelineSpec document, then `---` and a `platforms` document).

Design choices:
- The YAML is read as plain dicts, field names as the SDK writes them (camelCase protobuf JSON); nothing is
  re-validated against the protobuf schema (the KFP SDK compiled it, the API server would accept it).
- What the twin does not model is refused up front with `TwinUnsupported`, naming the field, rather than
  being silently ignored (a run that "passes" because a feature was skipped would be worse than no run).

Rules and their sources:
- Root parameters: the API server / Argo compiler fills runtime parameters missing from the run with the root
  `inputDefinitions` defaults, and optional ones without a default with null; a required one without a value
  is refused (KFP backend/src/v2/compiler/argocompiler/argo.go Compile; backend/src/apiserver/template/
  v2_template.go "Missing required parameter").
- Implicit dependencies: a task depends on the producers of its taskOutputParameter/taskOutputArtifact inputs
  as well as its `dependentTasks` (backend/src/v2/compiler/argocompiler/dag.go addImplicitDependencies).
- Exit tasks: a task whose `triggerPolicy.strategy` is ALL_UPSTREAM_TASKS_COMPLETED is compiled into an Argo
  exit lifecycle hook of the task it depends on, not a DAG task (dag.go DAG, common.go addExitTask).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tests.twin.gofmt import to_value

EXIT_STRATEGY = "ALL_UPSTREAM_TASKS_COMPLETED"
_SUPPORTED_K8S = {
    "secretAsEnv",
    "fieldPathAsEnv",
    "nodeSelector",
    "tolerations",
    "podMetadata",
    "activeDeadlineSeconds",
    "emptyDirMounts",
    "imagePullPolicy",
    "imagePullSecret",
}


class TwinUnsupported(ValueError):
    """The pipeline uses something the twin does not model; the message names it."""


@dataclass
class PipelineIR:
    spec: dict[str, Any]
    platform: dict[str, Any]
    source: str

    @property
    def name(self) -> str:
        return self.spec["pipelineInfo"]["name"]

    @property
    def root(self) -> dict[str, Any]:
        return self.spec["root"]

    def component(self, name: str) -> dict[str, Any]:
        try:
            return self.spec["components"][name]
        except KeyError:
            raise TwinUnsupported(f"component spec for {name!r} not found") from None

    def container(self, component: dict[str, Any]) -> dict[str, Any]:
        label = component["executorLabel"]
        executor = self.spec["deploymentSpec"]["executors"][label]
        if "container" not in executor:
            raise TwinUnsupported(f"executor {label!r} is not a container (importer/resolver/custom job)")
        return executor["container"]

    def k8s_config(self, component: dict[str, Any]) -> dict[str, Any]:
        """The kubernetes executor config of a container component ({} when it has none)."""
        executors = self.platform.get("kubernetes", {}).get("deploymentSpec", {}).get("executors", {})
        return executors.get(component.get("executorLabel", ""), {})

    def root_arguments(self, arguments: dict[str, Any] | None) -> dict[str, Any]:
        """Runtime parameters of the root DAG: given ones, then defaults, then null for optional ones."""
        defs = self.root.get("inputDefinitions", {}).get("parameters", {})
        args = {k: to_value(v) for k, v in (arguments or {}).items()}
        unknown = sorted(set(args) - set(defs))
        if unknown:
            raise ValueError(f"unknown pipeline parameters {unknown}; the pipeline has {sorted(defs)}")
        for name, d in defs.items():
            if name in args:
                continue
            if "defaultValue" in d:
                args[name] = to_value(d["defaultValue"])
            elif d.get("isOptional"):
                args[name] = None
            else:
                raise ValueError(f"Missing required parameter {name!r}")
        return args


def load_ir(source: str | Path) -> PipelineIR:
    """Read a compiled pipeline from a file path or from the YAML text itself."""
    text = Path(source).read_text() if isinstance(source, Path) or "\n" not in str(source) else str(source)
    docs = [d for d in yaml.safe_load_all(text) if d is not None]
    if not docs or "pipelineInfo" not in docs[0]:
        raise ValueError("not a compiled KFP pipeline (no pipelineInfo in the first YAML document)")
    ir = PipelineIR(
        spec=docs[0],
        platform=(docs[1] if len(docs) > 1 else {}).get("platforms", {}),
        source=str(source) if "\n" not in str(source) else "<text>",
    )
    check_supported(ir)
    return ir


def task_dependencies(task: dict[str, Any]) -> list[str]:
    """dependentTasks plus the producers of the task's inputs (dag.go addImplicitDependencies)."""
    deps = list(task.get("dependentTasks", []))
    inputs = task.get("inputs", {})
    for spec in list(inputs.get("parameters", {}).values()) + list(inputs.get("artifacts", {}).values()):
        for kind in ("taskOutputParameter", "taskOutputArtifact"):
            producer = spec.get(kind, {}).get("producerTask")
            if producer and producer not in deps:
                deps.append(producer)
    return deps


_PIPELINE_CONFIG = {
    "activeDeadlineSeconds",
    "resourceTtlOnCompletion",
    "resourceTtlOnSuccess",
    "resourceTtlOnFailure",
}


def workflow_deadline_s(ir: PipelineIR) -> float | None:
    """platforms.kubernetes.pipelineConfig.activeDeadlineSeconds -> the workflow's activeDeadlineSeconds
    (argocompiler/argo.go buildActiveDeadlineSeconds: only a value > 0 is set)."""
    v = ir.platform.get("kubernetes", {}).get("pipelineConfig", {}).get("activeDeadlineSeconds")
    return float(v) if v and float(v) > 0 else None


def is_exit_task(task: dict[str, Any]) -> bool:
    return task.get("triggerPolicy", {}).get("strategy") == EXIT_STRATEGY


def check_supported(ir: PipelineIR) -> None:
    """Refuse what the twin does not model (see the package docstring)."""
    extra = sorted(set(ir.platform.get("kubernetes", {}).get("pipelineConfig", {})) - _PIPELINE_CONFIG)
    if extra:
        raise TwinUnsupported(f"platforms.kubernetes.pipelineConfig {extra} is not modelled")
    dags = [("root", ir.root)] + [(n, c) for n, c in ir.spec.get("components", {}).items() if "dag" in c]
    for dag_name, comp in dags:
        for tname, task in comp["dag"].get("tasks", {}).items():
            where = f"task {tname!r} of {dag_name!r}"
            if task.get("triggerPolicy", {}).get("condition"):
                raise TwinUnsupported(f"{where}: triggerPolicy.condition (dsl.If/Elif/Else) is not modelled")
            if "artifactIterator" in task:
                raise TwinUnsupported(f"{where}: artifactIterator is not implemented (nor in KFP's driver)")
            for pname, p in task.get("inputs", {}).get("parameters", {}).items():
                if "parameterExpressionSelector" in p:
                    raise TwinUnsupported(f"{where}: input {pname!r} uses a parameterExpressionSelector")
            child = ir.component(task["componentRef"]["name"])
            if "executorLabel" in child:
                ir.container(child)
                extra = sorted(set(ir.k8s_config(child)) - _SUPPORTED_K8S)
                if extra:
                    raise TwinUnsupported(f"{where}: kubernetes executor config {extra} is not modelled")
            elif "dag" in child and child["dag"].get("outputs", {}).get("artifacts"):
                raise TwinUnsupported(f"{where}: DAG output artifacts are not modelled")
