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
- Retry nodes above DAG templates (dagretry.py has the rules and their sources): the root, every container
  task's executor DAG, sub-DAG, ParallelFor iterator DAG, iteration and exit hook has a chain of them when the
  controller sets `templateDefaults.retryStrategy` (KFP 2.17's stock OnError, limit 2): a DAG attempt that
  ends Error runs again from scratch (every task in it, with fresh nodes and pods), the levels inside it
  first. A re-run's tasks are recorded under `<key>(<n>)/...` (n: the re-runs so far), the first attempt's
  under `<key>/...`.
- TaskNode names: `<dag node>.<task>` plus `(<attempt>)` per retry node; a loop's iteration i runs under
  `<loop node>.iteration-iterations(i:i)(<a>).iteration-item(<b>)`; an exit hook under
  `<hooked task node>.onExit(<a>)`.
- A sub-DAG task whose driver fails is Omitted and its branch Failed (dagretry.py): an exit hook on it (the
  `dsl.ExitHandler` group) does not run, because Argo runs a hook only for a Completed node
  (exit_handler.go runOnExitNode, called from dag.go executeDAGTask / executeDAG for Completed nodes only).
- After KFP's TerminateRun (spec.activeDeadlineSeconds = 0) no new pod is created except on-exit pods
  (workflowpod.go createWorkflowPod), and nodes left without a pod are failed "Step exceeded its deadline"
  (operator.go failNodesWithoutCreatedPodsAfterDeadlineOrShutdown).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tests.twin.argo import expanded_name
from tests.twin.dagretry import Retries, chain, dag_phase, dag_template_strategy, hook_runs, settle
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
    retries: Retries | None = None
    driver_phase: str | None = None
    """a sub-DAG task's driver, when it did not succeed (the task is then Omitted)"""
    child: DagRun | None = None
    items: list[Any] = field(default_factory=list)
    iterations: list[DagSlot] = field(default_factory=list)
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


@dataclass
class DagSlot:
    """The retry chain of a DagRun that is not a task's own (the root, one ParallelFor iteration) and its
    current attempt."""

    key: str
    component: dict[str, Any]
    inputs: dict[str, Any]
    on_exit: bool
    iteration: int | None
    retries: Retries
    dag: DagRun | None = None
    phase: str = "Running"
    message: str = ""
    reason: str = ""

    @property
    def done(self) -> bool:
        return self.phase != "Running"


def _attempt_key(key: str, restarts: int) -> str:
    return key if restarts == 0 else f"{key or 'root'}({restarts})"


class DagMixin:
    """DAG progression; mixed into engine.TwinExecution."""

    ir: Any
    run_ctx: Any
    record: Any
    terminated: bool
    workflow: str
    workflow_defaults: Any
    transient_error_pattern: str | None

    # --- retry chains (dagretry.py) ---
    def _dag_strategy(self) -> dict[str, Any] | None:
        return dag_template_strategy(self.workflow_defaults)

    def _settle(self, r: Retries, phase: str, message: str):  # -> dagretry.Settled
        return settle(
            r,
            phase,
            message,
            self.now_cluster(),
            deadline_exceeded=self.terminated,
            transient_pattern=self.transient_error_pattern,
        )

    def _new_root(self, inputs: dict[str, Any]) -> DagSlot:
        r = chain([self.workflow, ".root"], ["entrypoint", "root"], self._dag_strategy(), self.now_cluster())
        slot = DagSlot("", self.ir.root, inputs, False, None, r)
        self._start_slot(slot)
        return slot

    def _start_slot(self, slot: DagSlot) -> None:
        key = _attempt_key(slot.key, slot.retries.restarts)
        r = slot.retries
        slot.dag = self._new_dag(key, slot.component, slot.inputs, r.name(), slot.on_exit, slot.iteration)

    def _advance_slot(self, slot: DagSlot) -> None:
        assert slot.dag is not None
        if slot.retries.waiting is None:
            self._advance_dag(slot.dag)
            if not slot.dag.done:
                return
        elif self.now_cluster() < slot.retries.waiting[1] and not self.terminated:
            return
        s = self._settle(slot.retries, slot.dag.phase, "")
        if s.action == "retry":
            self._start_slot(slot)
        elif s.action == "done":
            slot.phase, slot.message, slot.reason = s.phase, s.message, s.reason

    # --- tasks ---
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
        own = {"container": "system-container-executor", "dag": name, "loop": f"{name}-iterator"}[kind]
        if exit_task:
            segments, templates = [f"{dag.argo_name}.{deps[0]}.onExit", f".{name}"], ["exit-hook", own]
        else:
            segments, templates = [f"{dag.argo_name}.{name}"], [own]
        retries = chain(segments, templates, self._dag_strategy(), 0.0)
        rec = TaskRecord(
            key=key,
            name=name,
            display_name=task.get("taskInfo", {}).get("name", name),
            kind=kind,
            on_exit=dag.on_exit or exit_task,
            iteration=dag.iteration,
        )
        self.record.tasks[key] = rec
        node = TaskNode(rec, task, comp, dag, retries.name(), deps, exit_task, retries=retries)
        dag.nodes[name] = node
        return node

    def _finish(self, node: TaskNode, phase: str, message: str = "", reason: str = "") -> None:
        """The task's work ended with `phase` (or, not started, it is Omitted/Failed): Argo's retry nodes
        above it decide whether it runs again."""
        r = node.retries
        ran = node.started and (node.record.kind != "container" or node.record.attempts)
        if r is not None and ran and node.driver_phase is None:
            s = self._settle(r, phase, message)
            if s.action == "wait":
                node.record.reason = f"backoff of the {r.levels[s.level].template} retry node"
                return
            if s.action == "retry":
                self._restart(node)
                why = reason or message
                node.record.reason = (
                    f"{r.levels[s.level].template} retry node: a new attempt after {phase}: {why}"
                )
                return
            phase, message, reason = (
                s.phase,
                s.message,
                "; ".join(filter(None, (reason or message, s.reason))),
            )
        node.record.phase, node.record.message, node.record.reason = phase, message, reason or message

    def _restart(self, node: TaskNode) -> None:
        """A new attempt of the task's DAG (its executor DAG, sub-DAG, iterator DAG or exit hook)."""
        assert node.retries is not None
        node.argo_name = node.retries.name()
        node.record.phase = "Running"
        n = node.retries.restarts
        if node.record.kind == "container":
            node.state.update(attempt_base=len(node.record.attempts), exec_deadline=None)
            self._new_attempt(node)
        elif node.record.kind == "dag":
            node.child = self._new_dag(
                f"{node.record.key}({n})",
                node.component,
                node.record.inputs,
                node.argo_name,
                node.record.on_exit,
                node.dag.iteration,
            )
        else:
            node.iterations, node.state = [], {}
            self._start_loop(node)

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
            dag.phase = dag_phase(
                {
                    n.record.name: (n.record.phase, [d for d in n.deps if d in dag.nodes], n.driver_phase)
                    for n in dag.nodes.values()
                    if not n.exit_task
                }
            )

    def _maybe_start(self, dag: DagRun, node: TaskNode) -> None:
        deps = [dag.nodes[d] for d in node.deps]
        if not all(d.record.done for d in deps):
            return
        if node.exit_task:
            if not hook_runs(deps[0].record.phase):
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
        assert node.retries is not None
        for lv in node.retries.levels:
            lv.started = self.now_cluster()
        if node.record.kind == "container":
            self._start_container(node)
        elif node.record.kind == "dag":
            try:
                inputs = resolve_inputs(
                    node.task, node.component, dag, self.run_ctx, node.record.name, dag_driver=True
                )
            except ResolveError as e:
                node.driver_phase = "Failed"
                self._finish(node, "Omitted", "omitted: depends condition not met", f"driver failed: {e}")
                return
            node.record.inputs = inputs
            node.child = self._new_dag(
                node.record.key, node.component, inputs, node.argo_name, node.record.on_exit, dag.iteration
            )
        else:
            self._start_loop(node)

    def _start_loop(self, node: TaskNode) -> None:
        """The iterator DAG: its iteration-driver counts the items."""
        try:
            node.loop_inputs = resolve_inputs(
                node.task, node.component, node.dag, self.run_ctx, node.record.name, dag_driver=True
            )
        except ResolveError as e:
            self._finish(node, "Failed", f"driver: {e}", f"iteration-driver failed to resolve inputs: {e}")
            return
        node.record.inputs = node.loop_inputs
        node.items = iterator_items(node.task, node.loop_inputs)
        if not node.items:
            self._finish(node, "Succeeded", "", "Skipped, empty params (the loop DAG Succeeded)")

    def _advance_node(self, node: TaskNode) -> None:
        r = node.retries
        if r is not None and r.waiting is not None:
            if self.now_cluster() >= r.waiting[1] or self.terminated:
                self._finish(node, "", "")  # the backoff is over: decide that level again
            return
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
        n = node.retries.restarts if node.retries else 0
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
            segments = [f"{node.argo_name}.{expanded_name('iteration-iterations', i, i)}", ".iteration-item"]
            r = chain(segments, ["iterations", "iteration-item"], self._dag_strategy(), self.now_cluster())
            key = f"{_attempt_key(node.record.key, n)}/{i}"
            slot = DagSlot(key, node.component, inputs, node.record.on_exit, i, r)
            self._start_slot(slot)
            node.iterations.append(slot)
        for it in node.iterations:
            if not it.done:
                self._advance_slot(it)
        started_all = len(node.iterations) == len(node.items) or node.state.get("stopped")
        if started_all and all(it.done for it in node.iterations):
            bad = [it for it in node.iterations if it.phase != "Succeeded"]
            stopped = node.state.get("stopped", "")
            if bad or stopped:
                failed = [it.iteration for it in bad]
                why = "; ".join(x for x in (f"iterations {failed} failed" if failed else "", stopped) if x)
                phase = bad[-1].phase if bad and not stopped else "Failed"  # the TaskGroup's: the last
                self._finish(node, phase, DEADLINE_MSG if self.terminated else why, why)
            else:
                self._finish(node, "Succeeded")
