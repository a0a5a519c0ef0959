"""The DAG side of a run: which KFP task starts when, ParallelFor iterations, exit handlers, DAG phases.

Design choices:
- `DagRun` is one execution of a DAG component (the root, a sub-DAG such as an ExitHandler body, or one
  ParallelFor iteration); it is also the driver's `Scope` for the tasks in it. `TaskNode` is one KFP task
  in it.
- `DagMixin` is mixed into the twin's controller (`engine.TwinExecution`), which supplies the container part
  (`_start_container`, `_advance_container`) and the clock; everything here runs under the controller's lock.

Rules and their sources (KFP 2.17.0 compiler + Argo v4.0.5 controller):
- A task runs when every dependency (dependentTasks + producers of its inputs) Succeeded: KFP compiles
  `depends: "a.Succeeded && b.Succeeded"` (argocompiler/dag.go depends); once they are all fulfilled and one
  did not succeed, Argo marks it Omitted (workflow/controller/dag.go executeDAGTask, evaluateDependsLogic).
- Tasks whose dependencies are met keep starting after a sibling failed (Argo's `failFast` only decides the
  DAG's phase, dag.go assessDAGPhase; the template-level FailFast of checkParallelism is unset in KFP's
  templates). A DAG is done when every node in it is fulfilled; it Failed when a task in it Failed/Errored.
- ParallelFor (argocompiler/dag.go iteratorTask, iterationItemTask): an iterator DAG whose driver counts the
  items, then a `withSequence` over them; `iteratorPolicy.parallelismLimit` becomes the loop template's
  `parallelism`, which caps the *running iterations* (operator.go checkParallelism, getActiveChildren on the
  loop's boundary). No items: the task group is Skipped and the loop DAG Succeeded (assessDAGPhase).
- Exit handler (argocompiler/dag.go DAG + common.go addExitTask): an ALL_UPSTREAM_TASKS_COMPLETED task runs
  as the exit lifecycle hook of the task it depends on, once that task Completed - Succeeded, Failed or
  Error, not Omitted (exit_handler.go runOnExitNode, workflow_types.go Completed). Its pods are on-exit
  pods. The hook node is a child of the task, not a DAG target: the DAG waits for it, its outcome does not
  change the DAG's phase (assessDAGPhase only reads target tasks).
- TaskNode names: `<dag node>.<task>`; a loop's iteration i runs under
  `<loop node>.iteration-iterations(i:i).iteration-item`; an exit hook under `<hooked task node>.onExit`.
- After KFP's TerminateRun (spec.activeDeadlineSeconds = 0) no new pod is created except on-exit pods
  (workflowpod.go createWorkflowPod), and nodes left without a pod are failed "Step exceeded its deadline"
  (operator.go failNodesWithoutCreatedPodsAfterDeadlineOrShutdown).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tests.twin.argo import expanded_name
from tests.twin.ir import TwinUnsupported, is_exit_task, task_dependencies
from tests.twin.records import TaskRecord
from tests.twin.resolve import (
    ResolveError,
    dag_output,
    final_status,
    iteration_inputs,
    iterator_items,
    resolve_inputs,
)

DEADLINE_MSG = "Step exceeded its deadline"


@dataclass
class TaskNode:
    record: TaskRecord
    task: dict[str, Any]
    component: dict[str, Any]
    dag: DagRun
    argo_name: str
    deps: list[str]
    exit_task: bool
    started: bool = False
    child: DagRun | None = None
    items: list[Any] = field(default_factory=list)
    iterations: list[DagRun] = field(default_factory=list)
    loop_inputs: dict[str, Any] = field(default_factory=dict)
    state: dict[str, Any] = field(default_factory=dict)
    """the container part's own state (engine)"""


@dataclass
class DagRun:
    key: str
    component: dict[str, Any]
    inputs: dict[str, Any]
    argo_name: str
    execution_id: int
    on_exit: bool
    iteration: int | None
    run: Any
    nodes: dict[str, TaskNode] = field(default_factory=dict)
    phase: str = "Running"

    # --- the driver's Scope ---
    def task_output(self, producer: str, key: str) -> Any:
        node = self.nodes.get(producer)
        if node is None:
            raise ResolveError(f"producer task, {producer}, not in tasks")
        if node.record.kind == "container":
            if key not in node.record.outputs:
                raise ResolveError(f"producer task {producer!r} has no output parameter {key!r}")
            return node.record.outputs[key]
        if node.record.kind == "loop":
            raise TwinUnsupported(
                f"output {key!r} of ParallelFor {producer!r} (dsl.Collected) is not modelled"
            )
        sub, sub_key = dag_output(node.component, key)
        assert node.child is not None
        return node.child.task_output(sub, sub_key)

    def task_final_status(self, producer: str) -> dict[str, Any]:
        node = self.nodes[producer]
        return final_status("COMPLETE" if node.record.phase == "Succeeded" else "FAILED", producer, self.run)

    @property
    def done(self) -> bool:
        return self.phase != "Running"


class DagMixin:
    """DAG progression; mixed into engine.TwinExecution."""

    ir: Any
    run_ctx: Any
    record: Any
    terminated: bool

    def _new_dag(
        self,
        key: str,
        component: dict[str, Any],
        inputs: dict[str, Any],
        argo_name: str,
        on_exit: bool,
        iteration: int | None,
    ) -> DagRun:
        self._exec_ids = getattr(self, "_exec_ids", 0) + 1
        dag = DagRun(key, component, inputs, argo_name, self._exec_ids, on_exit, iteration, self.run_ctx)
        for name, task in component["dag"].get("tasks", {}).items():
            self._add_node(dag, name, task)
        return dag

    def _add_node(self, dag: DagRun, name: str, task: dict[str, Any]) -> TaskNode:
        comp = self.ir.component(task["componentRef"]["name"])
        exit_task = is_exit_task(task)
        deps = task_dependencies(task)
        if exit_task and len(deps) != 1:
            raise TwinUnsupported(f"exit task {name!r} depends on {deps}; only one hooked task is modelled")
        kind = "loop" if "parameterIterator" in task else "dag" if "dag" in comp else "container"
        key = f"{dag.key}/{name}" if dag.key else name
        argo = f"{dag.argo_name}.{deps[0]}.onExit.{name}" if exit_task else f"{dag.argo_name}.{name}"
        rec = TaskRecord(
            key=key,
            name=name,
            display_name=task.get("taskInfo", {}).get("name", name),
            kind=kind,
            on_exit=dag.on_exit or exit_task,
            iteration=dag.iteration,
        )
        self.record.tasks[key] = rec
        node = TaskNode(rec, task, comp, dag, argo, deps, exit_task)
        dag.nodes[name] = node
        return node

    def _finish(self, node: TaskNode, phase: str, message: str = "", reason: str = "") -> None:
        node.record.phase, node.record.message, node.record.reason = phase, message, reason or message

    def _advance_dag(self, dag: DagRun) -> None:
        for name in sorted(dag.nodes):
            node = dag.nodes[name]
            if node.record.done:
                continue
            if not node.started:
                self._maybe_start(dag, node)
            if node.started and not node.record.done:
                self._advance_node(node)
        if all(n.record.done for n in dag.nodes.values()):
            bad = [
                n.record.phase
                for n in dag.nodes.values()
                if not n.exit_task and n.record.phase in ("Failed", "Error")
            ]
            dag.phase = ("Failed" if "Failed" in bad else "Error") if bad else "Succeeded"

    def _maybe_start(self, dag: DagRun, node: TaskNode) -> None:
        deps = [dag.nodes[d] for d in node.deps]
        if not all(d.record.done for d in deps):
            return
        if node.exit_task:
            if deps[0].record.phase not in ("Succeeded", "Failed", "Error"):
                self._finish(
                    node, "Omitted", "", f"exit hook not run: {deps[0].record.key} is {deps[0].record.phase}"
                )
                return
        elif not all(d.record.phase == "Succeeded" for d in deps):
            self._finish(
                node,
                "Omitted",
                "omitted: depends condition not met",
                f"omitted: {', '.join(d.record.name + ' ' + d.record.phase for d in deps)}",
            )
            return
        if self.terminated and not node.record.on_exit:
            self._finish(
                node, "Failed", DEADLINE_MSG, "not started: the run was terminated (activeDeadlineSeconds 0)"
            )
            return
        node.started = True
        node.record.phase = "Running"
        try:
            if node.record.kind == "container":
                self._start_container(node)
            elif node.record.kind == "dag":
                inputs = resolve_inputs(
                    node.task, node.component, dag, self.run_ctx, node.record.name, dag_driver=True
                )
                node.record.inputs = inputs
                node.child = self._new_dag(
                    node.record.key,
                    node.component,
                    inputs,
                    node.argo_name,
                    node.record.on_exit,
                    dag.iteration,
                )
            else:
                node.loop_inputs = resolve_inputs(
                    node.task, node.component, dag, self.run_ctx, node.record.name, dag_driver=True
                )
                node.record.inputs = node.loop_inputs
                node.items = iterator_items(node.task, node.loop_inputs)
                if not node.items:
                    self._finish(node, "Succeeded", "", "Skipped, empty params (the loop DAG Succeeded)")
        except ResolveError as e:
            self._finish(node, "Failed", f"driver: {e}", f"driver failed to resolve inputs: {e}")

    def _advance_node(self, node: TaskNode) -> None:
        if node.record.kind == "container":
            self._advance_container(node)
        elif node.record.kind == "dag":
            assert node.child is not None
            self._advance_dag(node.child)
            if node.child.done:
                self._finish(node, node.child.phase)
        else:
            self._advance_loop(node)

    def _advance_loop(self, node: TaskNode) -> None:
        limit = int(node.task.get("iteratorPolicy", {}).get("parallelismLimit", 0) or 0)
        while len(node.iterations) < len(node.items) and not node.state.get("stopped"):
            if limit and sum(1 for it in node.iterations if not it.done) >= limit:
                break
            i = len(node.iterations)
            if self.terminated and not node.record.on_exit:
                node.state["stopped"] = f"iterations {i}.. not started: the run was terminated"
                break
            try:
                inputs = iteration_inputs(node.task, node.component, node.loop_inputs, node.items, i)
            except ResolveError as e:
                node.state["stopped"] = f"iteration {i}: driver: {e}"
                break
            argo = f"{node.argo_name}.{expanded_name('iteration-iterations', i, i)}.iteration-item"
            node.iterations.append(
                self._new_dag(f"{node.record.key}/{i}", node.component, inputs, argo, node.record.on_exit, i)
            )
        for it in node.iterations:
            if not it.done:
                self._advance_dag(it)
        started_all = len(node.iterations) == len(node.items) or node.state.get("stopped")
        if started_all and all(it.done for it in node.iterations):
            failed = [it.iteration for it in node.iterations if it.phase != "Succeeded"]
            stopped = node.state.get("stopped", "")
            if failed or stopped:
                why = "; ".join(x for x in (f"iterations {failed} failed" if failed else "", stopped) if x)
                self._finish(node, "Failed", DEADLINE_MSG if self.terminated else why, why)
            else:
                self._finish(node, "Succeeded")
