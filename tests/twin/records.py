"""What a twin run leaves for a test to read: the workflow, every task, every attempt (= pod) of every task.

Design choices:
- Times are kept twice: real seconds since the run started (what the processes lived through) and cluster
  seconds (real * time_scale: what Argo's and Kubernetes' durations are measured in).
- Phases are Argo node phases: Pending, Running, Succeeded, Failed, Error, Omitted (a dependency did not
  succeed), Skipped (an empty ParallelFor). `reason` says in words which rule produced the outcome.
- `explain()` is what a failing assertion should print: the failed tasks, their attempts, and the tail of
  the failing attempts' logs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class AttemptRecord:
    index: int
    node_name: str
    pod_name: str
    hostname: str
    log: Path
    created_real: float
    created_cluster: float
    phase: str = "Pending"
    node: str | None = None
    started_real: float | None = None
    started_cluster: float | None = None
    finished_real: float | None = None
    finished_cluster: float | None = None
    exit_code: int | None = None
    """the component process's exit status (negative: killed by that signal); the pod's main container, the
    launcher, would report 1 for any failure (glog.Exit)"""
    message: str = ""
    reason: str = ""
    status_reason: str = ""
    status_message: str = ""
    """the pod's own status.reason / status.message (set by the kubelet: Evicted, Terminated, ...)"""
    execution_deadline_cluster: float | None = None
    labels: dict[str, str] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    argv: list[str] = field(default_factory=list)
    uid: str = ""
    """the pod's metadata.uid"""

    @property
    def done(self) -> bool:
        return self.phase in ("Succeeded", "Failed", "Error")

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


@dataclass
class TaskRecord:
    key: str
    """path of KFP task names, e.g. "exit-handler-1/for-loop-1/0/learner" ("/<i>/" = iteration i)"""
    name: str
    display_name: str
    kind: str
    """container | dag | loop"""
    on_exit: bool = False
    iteration: int | None = None
    phase: str = "Pending"
    message: str = ""
    reason: str = ""
    attempts: list[AttemptRecord] = field(default_factory=list)
    executor_input: dict[str, Any] | None = None
    inputs: dict[str, Any] = field(default_factory=dict)
    outputs: dict[str, Any] = field(default_factory=dict)
    artifacts: dict[str, Any] = field(default_factory=dict)
    retry_strategy: dict[str, Any] | None = None

    @property
    def done(self) -> bool:
        return self.phase in ("Succeeded", "Failed", "Error", "Omitted", "Skipped")


@dataclass
class TwinRun:
    pipeline: str
    workflow: str
    run_id: str
    namespace: str
    work_dir: Path
    time_scale: float
    phase: str = "Running"
    message: str = ""
    terminated: bool = False
    timed_out: bool = False
    tasks: dict[str, TaskRecord] = field(default_factory=dict)
    api_requests: list[dict[str, Any]] = field(default_factory=list)
    elapsed_real: float = 0.0

    def find(self, name: str) -> list[TaskRecord]:
        """Tasks by KFP task name (all iterations of a ParallelFor body), in key order."""
        return [self.tasks[k] for k in sorted(self.tasks) if self.tasks[k].name == name]

    def task(self, name: str) -> TaskRecord:
        found = self.find(name)
        if len(found) != 1:
            raise KeyError(f"{len(found)} tasks named {name!r} (keys: {sorted(self.tasks)})")
        return found[0]

    def attempts(self) -> list[AttemptRecord]:
        return sorted((a for t in self.tasks.values() for a in t.attempts), key=lambda a: a.created_real)

    def explain(self, lines: int = 25) -> str:
        out = [
            f"twin run {self.workflow} ({self.pipeline}, run id {self.run_id}): "
            f"{self.phase} {self.message}".rstrip(),
            f"work dir: {self.work_dir}",
        ]
        for key in sorted(self.tasks):
            t = self.tasks[key]
            out.append(f"  {key}: {t.phase} {t.reason or t.message}".rstrip())
            for a in t.attempts:
                out.append(
                    f"    #{a.index} {a.pod_name}: {a.phase} exit={a.exit_code} "
                    f"{a.reason or a.message}".rstrip()
                )
        bad = [
            a for t in self.tasks.values() for a in t.attempts if a.phase in ("Failed", "Error", "Pending")
        ]
        for a in bad[-3:]:
            out += [f"--- last {lines} log lines of {a.pod_name} ({a.log}) ---", a.tail(lines)]
        return "\n".join(out)
