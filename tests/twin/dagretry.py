"""The retry nodes Argo puts above KFP's DAG templates, and how a DAG's phase is assessed: pure decisions.

Design choices:
- `Retries` is the chain of Argo retry nodes above one piece of work the twin runs as a unit (a container
  task's executor DAG, a sub-DAG, a ParallelFor's iterator DAG, one iteration, the root): one `RetryLevel`
  per Argo template in the chain, outermost first. `settle` is what Argo decides, level by level from the
  innermost out, when that work ends: a new attempt at some level (the levels inside it start over), a
  backoff to wait out, or the phase the outermost node ends with. It calls `argo.retry_decision`
  (processNodeRetries) for every level, so DAG retries follow exactly the rules of pod retries.
- `name` composes the Argo node name of the current attempt from the levels' segments:
  `<segment 0>(<attempt>)<segment 1>(<attempt>)...`, without `(n)` where a level has no retryStrategy.
- `dag_phase` is assessDAGPhase over the KFP tasks of one DAG attempt.

Rules and their sources (Argo v4.0.5 workflow/controller, KFP 2.17.0 backend/src/v2/compiler/argocompiler):
- operator.go mergedTemplateDefaultsInto unsets only the template-*type* fields of `templateDefaults`
  (container, dag, script, ...) that do not match the template; `retryStrategy` is not one, so the
  controller's `templateDefaults.retryStrategy` reaches every template: DAG templates, KFP's driver templates
  and the executor alike (argo-workflows issue #13990 asks for the opposite, open). KFP compiles a
  retryStrategy only on the executor's impl template (container.go addContainerExecutorTemplate); its DAG
  templates (dag.go DAG, iteratorTask, iterationItemTask, the `exit-hook-*` templates,
  `system-container-executor`) have none, so theirs is exactly the default (`argo.effective_retry_strategy`
  with no template strategy), and none at all without workflowDefaults.
- operator.go executeTemplate: any template with a retryStrategy gets a Retry node `<name>` whose attempts
  are `<name>(0)`, `<name>(1)`, ...; a DAG attempt's tasks are named `<attempt>.<task>` (dag.go
  taskNodeName), so a re-run DAG runs every task again (fresh nodes, fresh pods), including tasks that had
  succeeded. processNodeRetries is the same for every node type: an `Error` attempt is retried under
  OnError/Always, a `Failed` one under OnFailure/Always, up to `limit`.
- The chains KFP's compiled workflow makes (argocompiler dag.go, container.go; operator.go executeTemplate
  with the workflow name as the entrypoint's node): the entrypoint DAG `<wf>`, in it `root` (its driver beside
  it); a container task `<name>` is the `system-container-executor` DAG whose one task `executor` is the impl
  pod template; a sub-DAG task `<name>` (driver beside it) is the component's DAG; a ParallelFor `<name>` is
  the iterator DAG (`iteration-driver` + `iteration-iterations` withSequence), each iteration
  `iteration-iterations(i:i)` an iterations DAG holding `iteration-item` (driver beside it), the body's DAG;
  an exit task runs in the hook's `exit-hook-*` DAG, node `<hooked task>.onExit` (common/util.go
  GenerateOnExitNodeName), the task inside it as usual.
- dag.go assessDAGPhase: a DAG is Running while any node in it is not fulfilled; its targets are the tasks no
  other task depends on (findLeafTaskNames, sorted); an Omitted target takes the phase of the branch that
  led to it, Failed/Error preferred over Succeeded; with failFast (KFP sets none: default true) the DAG takes
  the phase of the first target, in name order, whose branch Failed or Errored, else Succeeded. A KFP task
  whose driver failed is Omitted (its `<name>` depends on `<name>-driver.Succeeded`, dag.go depends) and its
  branch has the driver's phase.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tests.twin.argo import AttemptView, effective_retry_strategy, retry_decision

FAILED_OR_ERROR = ("Failed", "Error")


def dag_template_strategy(workflow_defaults: dict[str, Any] | None) -> dict[str, Any] | None:
    """The retryStrategy of every DAG template KFP compiles: the controller's default, if any."""
    return effective_retry_strategy(None, workflow_defaults)


@dataclass
class RetryLevel:
    """One Argo retry node (or a plain node, strategy None) in a chain."""

    template: str
    strategy: dict[str, Any] | None
    ended: list[AttemptView] = field(default_factory=list)
    """this level's attempts that ended, within the current attempt of the level outside it"""
    started: float = 0.0

    def suffix(self) -> str:
        return f"({len(self.ended)})" if self.strategy is not None else ""


@dataclass
class Retries:
    segments: list[str]
    levels: list[RetryLevel]
    restarts: int = 0
    """attempts made after the first, at any level (the twin's key suffix)"""
    waiting: tuple[int, float] | None = None
    """(level, until): a backoff Argo waits out before deciding that level again"""

    def name(self) -> str:
        return "".join(seg + lv.suffix() for seg, lv in zip(self.segments, self.levels, strict=True))

    def attempts(self) -> list[int]:
        return [len(lv.ended) for lv in self.levels]


def chain(segments: list[str], templates: list[str], strategy: dict[str, Any] | None, now: float) -> Retries:
    return Retries(segments, [RetryLevel(t, strategy, started=now) for t in templates])


@dataclass
class Settled:
    action: str
    """retry | wait | done"""
    level: int = -1
    until: float | None = None
    phase: str = ""
    message: str = ""
    reason: str = ""


def settle(
    r: Retries,
    phase: str,
    message: str,
    now: float,
    *,
    deadline_exceeded: bool = False,
    transient_pattern: str | None = None,
) -> Settled:
    """What Argo does when the innermost attempt of `r` ended with `phase`: processNodeRetries at each level
    from the innermost out (or from the level whose backoff ended). Updates `r` (attempts, restarts)."""
    start = len(r.levels) - 1
    resume = r.waiting is not None
    if r.waiting is not None:
        start, r.waiting = r.waiting[0], None
    reasons: list[str] = []
    for i in range(start, -1, -1):
        lv = r.levels[i]
        if lv.strategy is None:
            continue  # no retry node: the node's phase is its DAG's
        if not (resume and i == start):
            lv.ended.append(AttemptView(phase, message, lv.started, now))
        d = retry_decision(
            lv.strategy,
            lv.ended,
            now,
            deadline_exceeded=deadline_exceeded,
            transient_pattern=transient_pattern,
        )
        if d.action == "wait":
            r.waiting = (i, d.until or now)
            return Settled("wait", i, until=d.until)
        if d.action == "retry":
            lv.started = now
            for inner in r.levels[i + 1 :]:
                inner.ended.clear()
                inner.started = now
            r.restarts += 1
            return Settled("retry", i)
        if len(lv.ended) > 1:  # a level that only passed its one attempt's outcome on keeps its message
            if d.action != "succeeded":
                reasons.append(f"{lv.template}: {len(lv.ended)} attempts, {d.reason or d.message}")
            message = d.message or message
        phase = d.phase
    return Settled("done", phase=phase, message=message, reason="; ".join(reasons))


def hook_runs(hooked_phase: str) -> bool:
    """exit_handler.go runOnExitNode is called only for a Completed hooked node (dag.go executeDAGTask,
    executeDAG): Succeeded, Failed or Error; never for an Omitted or Skipped one."""
    return hooked_phase in ("Succeeded", *FAILED_OR_ERROR)


def branch_phases(nodes: dict[str, tuple[str, list[str], str | None]]) -> dict[str, str]:
    """name -> the phase of the branch ending at that task: its own if Completed, its driver's if the driver
    failed (`nodes[name][2]`), else (Omitted, Skipped) the first Failed/Error branch among its dependencies,
    else Succeeded. nodes: name -> (phase, dependencies, driver phase or None)."""
    out: dict[str, str] = {}

    def phase_of(name: str) -> str:
        if name not in out:
            phase, deps, driver = nodes[name]
            if phase in ("Succeeded", *FAILED_OR_ERROR):
                out[name] = phase
            elif driver in FAILED_OR_ERROR:
                out[name] = driver
            else:
                bad = [p for p in (phase_of(d) for d in sorted(deps)) if p in FAILED_OR_ERROR]
                out[name] = bad[0] if bad else "Succeeded"
        return out[name]

    for n in nodes:
        phase_of(n)
    return out


def dag_phase(nodes: dict[str, tuple[str, list[str], str | None]]) -> str:
    """assessDAGPhase of a DAG whose tasks are all fulfilled (failFast): see the module docstring."""
    branches = branch_phases(nodes)
    needed = {d for _, deps, _ in nodes.values() for d in deps}
    for target in sorted(set(nodes) - needed):
        if branches[target] in FAILED_OR_ERROR:
            return branches[target]
    return "Succeeded"
