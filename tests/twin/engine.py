"""The twin's controller: one run of a compiled pipeline, from submission to a `TwinRun`.

Design choices:
- One controller thread reconciles the whole run every `tick_s` under one lock, like Argo's operate loop:
  poll pods, advance DAGs, decide retries. The API stand-in's thread takes the same lock.
- Time: the processes run in real time; every Argo/Kubernetes duration (backoff, maxDuration,
  activeDeadlineSeconds, the termination grace period) is divided by `time_scale`. "Cluster seconds" =
  real seconds * time_scale.
- Bounded and clean: a run-level real-time `timeout_s`; `abort()` (timeout, error, KeyboardInterrupt, context
  exit, interpreter exit) SIGKILLs every pod and every process carrying the run's marker.
- `terminate()` is KFP's TerminateRun: backend/src/apiserver/resource/resource_manager.go TerminateWorkflow
  patches the workflow with `spec.activeDeadlineSeconds: 0` (common/util/execution_spec.go
  GetTerminatePatch) - a deadline, not Argo's `spec.shutdown`. So (Argo exec_control.go, workflowpod.go,
  operator.go processNodeRetries) running and pending pods are stopped and failed, no new pod is created and
  no retry happens - except for on-exit pods: a dsl.ExitHandler's exit task still runs to its end.
  A workflow activeDeadlineSeconds compiled from `dsl.PipelineConfig` (argo.go buildActiveDeadlineSeconds)
  does the same when it passes (cluster seconds after the start).
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import uuid
import weakref
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tests.twin.apiview import ApiViewMixin
from tests.twin.attempts import ContainerMixin
from tests.twin.cluster import Cluster, generate_name, quantity
from tests.twin.dag import DEADLINE_MSG, DagMixin, TaskNode
from tests.twin.ir import PipelineIR, load_ir, workflow_deadline_s
from tests.twin.kubeapi import KubeAPI
from tests.twin.pods import PodProcess, default_python_bin, kill_marked
from tests.twin.records import AttemptRecord, TwinRun
from tests.twin.resolve import RunContext
from tests.twin.trainjobs import TrainJobs
from tests.twin.workers import WorkerPods

log = logging.getLogger(__name__)
_LIVE: weakref.WeakSet[TwinExecution] = weakref.WeakSet()


@atexit.register
def _abort_all() -> None:
    for ex in list(_LIVE):
        ex.abort("interpreter exit")


class Twin:
    """A compiled pipeline and the pretend cluster it runs on; `run()` / `start()` make one run.

    pipeline: path (or YAML text, or a PipelineIR) of the compiled two-document IR.
    work_dir: each run writes under `<work_dir>/<workflow name>/` (pods/<pod>/pod.log, artifacts, kubeconfig).
    cluster: namespace, nodes and secrets (default: `kubeflow`, `default_nodes()`, no secrets).
    workflow_defaults: the workflow-controller's parsed `workflowDefaults` (`KFP_2_17`,
        `load_workflow_defaults(path)`), or None for plain Argo.
    time_scale: Argo/Kubernetes durations are divided by it (60: 300 cluster seconds take 5 real seconds).
    timeout_s: real seconds after which the run is killed (TwinRun.timed_out).
    pending_timeout_s: real seconds a pod may be Pending for a reason that never resolves (unschedulable, a
        missing secret) before its task fails.
    termination_grace_s: terminationGracePeriodSeconds (cluster seconds) between SIGTERM and SIGKILL.
    env: the "image" environment every pod starts with, under the pod spec's own env.
    python_bin: the directory whose `python3` runs the components (default: this interpreter's).
    publish_logs: the driver's publish_logs (adds the `executor-logs` output artifact, as stock KFP does).
    workflow_name / run_id / run_display_name: fix what is random or derived otherwise.
    transient_error_pattern: Argo's TRANSIENT_ERROR_PATTERN, for retryPolicy OnTransientError.
    """

    def __init__(
        self,
        pipeline: str | Path | PipelineIR,
        work_dir: str | Path,
        *,
        cluster: Cluster | None = None,
        workflow_defaults: dict[str, Any] | None = None,
        time_scale: float = 1.0,
        timeout_s: float = 300.0,
        pending_timeout_s: float = 3.0,
        termination_grace_s: float = 30.0,
        env: dict[str, str] | None = None,
        python_bin: str | Path | None = None,
        publish_logs: bool = True,
        workflow_name: str | None = None,
        run_id: str | None = None,
        run_display_name: str | None = None,
        transient_error_pattern: str | None = None,
        tick_s: float = 0.02,
    ) -> None:
        self.ir = pipeline if isinstance(pipeline, PipelineIR) else load_ir(pipeline)
        self.work_dir = Path(work_dir).resolve()
        self.cluster = cluster or Cluster()
        self.workflow_defaults = workflow_defaults
        self.time_scale, self.timeout_s, self.tick_s = float(time_scale), float(timeout_s), tick_s
        self.pending_timeout_s, self.termination_grace_s = pending_timeout_s, termination_grace_s
        self.env, self.python_bin = dict(env or {}), Path(python_bin) if python_bin else default_python_bin()
        self.publish_logs, self.transient_error_pattern = publish_logs, transient_error_pattern
        self.workflow_name, self.run_id, self.run_display_name = workflow_name, run_id, run_display_name

    def start(self, arguments: dict[str, Any] | None = None) -> TwinExecution:
        return TwinExecution(self, arguments).start()

    def run(self, arguments: dict[str, Any] | None = None) -> TwinRun:
        with self.start(arguments) as ex:
            return ex.wait()


class TwinExecution(DagMixin, ContainerMixin, ApiViewMixin):
    """One running workflow. Use as a context manager (or call abort()) so nothing outlives it."""

    def __init__(self, twin: Twin, arguments: dict[str, Any] | None) -> None:
        self.twin, self.ir = twin, twin.ir
        self.cluster, self.workflow_defaults = twin.cluster, twin.workflow_defaults
        self.time_scale, self.grace_real = twin.time_scale, twin.termination_grace_s / twin.time_scale
        self.pending_timeout_s, self.transient_error_pattern = (
            twin.pending_timeout_s,
            twin.transient_error_pattern,
        )
        self.extra_env, self.python_bin, self.publish_logs = twin.env, twin.python_bin, twin.publish_logs
        self.workflow = twin.workflow_name or generate_name(self.ir.name + "-")
        run_id = twin.run_id or str(uuid.uuid4())
        self.work_dir = twin.work_dir / self.workflow
        self.pipeline_root = self.work_dir / "artifacts" / self.ir.name / run_id
        self.record = TwinRun(
            self.ir.name, self.workflow, run_id, self.cluster.namespace, self.work_dir, self.time_scale
        )
        self.run_ctx = RunContext(
            run_id=run_id,
            run_name=self.workflow,
            run_display_name=twin.run_display_name or self.ir.name,
            create_time_utc=datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        )
        self.root_args = self.ir.root_arguments(arguments)
        self.pods: dict[str, tuple[TaskNode, AttemptRecord]] = {}
        self.deleted: set[str] = set()
        self.dying: list[PodProcess] = []
        self.terminated = False
        self.lock = threading.RLock()
        self.finished = threading.Event()
        self.error: BaseException | None = None
        self.api = KubeAPI(self, self.record.api_requests.append)
        self.workflow_uid = str(uuid.uuid4())
        self.workers = WorkerPods(self)
        self.trainjobs = TrainJobs(self)
        self.kubeconfig = self.work_dir / "kubeconfig"
        self.thread = threading.Thread(target=self._loop, name=f"twin-{self.workflow}", daemon=True)

    # --- clock ---
    def now_real(self) -> float:
        return time.monotonic() - self.t0

    def now_cluster(self) -> float:
        return self.now_real() * self.time_scale

    # --- lifecycle ---
    def start(self) -> TwinExecution:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.api.start().write_kubeconfig(self.kubeconfig, self.cluster.namespace)
        self.t0, self.t0_wall = time.monotonic(), time.time()
        _LIVE.add(self)
        try:
            with self.lock:
                self.root = self._new_root(self.root_args)
        except BaseException:
            self._stop_api()
            raise
        self.thread.start()
        return self

    def __enter__(self) -> TwinExecution:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.abort("left the twin's context" if exc[0] is None else f"aborted by {exc[0].__name__}")

    def wait(self, timeout: float | None = None) -> TwinRun:
        """Block until the run ends; anything that interrupts the wait (KeyboardInterrupt, the `timeout` in
        real seconds passing: TimeoutError) aborts the run first."""
        try:
            if not self.finished.wait(timeout):
                raise TimeoutError(f"twin run {self.workflow} still running after {timeout}s")
        except BaseException:
            self.abort("interrupted")
            raise
        if self.error is not None:
            raise RuntimeError(f"twin controller failed: {self.error!r}") from self.error
        return self.record

    def wait_until(self, condition: Any, timeout: float = 30.0, poll_s: float = 0.02) -> TwinRun:
        """Poll `condition(record)` under the controller's lock until it holds (else TimeoutError); a KeyError
        or IndexError from the condition (a task or attempt that does not exist yet) counts as "not yet"."""
        end = time.monotonic() + timeout
        while True:
            with self.lock:
                try:
                    if condition(self.record):
                        return self.record
                except (KeyError, IndexError):
                    pass
                if self.finished.is_set():
                    raise TimeoutError(f"the run ended before the condition held:\n{self.record.explain()}")
            if time.monotonic() > end:
                with self.lock:
                    raise TimeoutError(f"condition not met within {timeout}s:\n{self.record.explain()}")
            time.sleep(poll_s)

    def terminate(self) -> None:
        """KFP TerminateRun (see the module docstring)."""
        with self.lock:
            self.record.terminated = True
            self._deadline_passed("stopped by the workflow deadline (KFP terminate)")

    def _deadline_passed(self, why: str) -> None:
        """The workflow's activeDeadlineSeconds has passed: what Argo does then (module docstring)."""
        with self.lock:
            self.terminated = True
            for node, a in self.pods.values():
                if node.record.on_exit or a.done or node.state.get("step") != "running":
                    continue
                node.state["proc"].terminate(self.grace_real)
                self.dying.append(node.state["proc"])
                self._end(node, a, "Failed", DEADLINE_MSG, why)

    def abort(self, why: str) -> None:
        """Kill everything now (idempotent)."""
        if self.finished.is_set() and not self.thread.is_alive() and not self._alive():
            self._stop_api()
            return
        with self.lock:
            if not self.finished.is_set():
                self.record.phase, self.record.message = "Failed", f"aborted: {why}"
            self._kill_all()
            self.finished.set()
        if threading.current_thread() is not self.thread:
            self.thread.join(timeout=10)
        self._stop_api()

    def _alive(self) -> bool:
        return any(p.returncode is None for p in self._procs())

    def _procs(self) -> list[PodProcess]:
        return [n.state["proc"] for n, _ in self.pods.values() if n.state.get("proc")] + self.dying

    def _kill_all(self) -> None:
        for p in [*self._procs(), *self.workers.procs()]:
            p.kill()
        kill_marked("TWIN_RUN_ID", self.record.run_id)

    def _stop_api(self) -> None:
        if not getattr(self, "_api_stopped", False):
            self._api_stopped = True
            self.api.stop()
            _LIVE.discard(self)

    # --- the controller ---
    def _loop(self) -> None:
        try:
            while not self.finished.is_set():
                with self.lock:
                    if self.finished.is_set():
                        break
                    self._tick()
                time.sleep(self.twin.tick_s)
        except BaseException as e:  # a bug or TwinUnsupported: end the run, keep the error for wait()
            log.exception("twin controller failed")
            self.error = e
            with self.lock:
                self.record.phase, self.record.message = "Error", f"twin controller failed: {e}"
                self._kill_all()
                self.finished.set()
        finally:
            self.record.elapsed_real = self.now_real()

    def _tick(self) -> None:
        self.dying = [p for p in self.dying if p.poll() is None]
        self.workers.poll()
        self.trainjobs.poll()
        deadline = workflow_deadline_s(self.ir)
        if deadline is not None and not self.terminated and self.now_cluster() >= deadline:
            self._deadline_passed(f"stopped by the workflow deadline (activeDeadlineSeconds {deadline:g})")
        if not self.root.done:
            self._advance_slot(self.root)
        if self.now_real() > self.twin.timeout_s:
            self.record.timed_out = True
            self.record.phase, self.record.message = (
                "Failed",
                f"twin timeout: still running after {self.twin.timeout_s:.0f}s",
            )
            self._kill_all()
            self.finished.set()
        elif self.root.done and not self.dying and not self._alive():
            self.record.phase = self.root.phase
            if self.record.terminated:
                self.record.message = "terminated: spec.activeDeadlineSeconds = 0 (KFP TerminateRun)"
            elif self.terminated:
                self.record.message = "the workflow's activeDeadlineSeconds passed"
            kill_marked("TWIN_RUN_ID", self.record.run_id)
            self.finished.set()

    def _gpus_in_use(self) -> dict[str, dict[str, float]]:
        used: dict[str, dict[str, float]] = {}
        for node, a in self.pods.values():
            proc = node.state.get("proc") if node.record.attempts[-1] is a else None
            if a.node and proc is not None and proc.returncode is None:
                for res, q in node.state["pod"].limits.items():
                    if res not in ("cpu", "memory"):
                        used.setdefault(a.node, {})[res] = used.get(a.node, {}).get(res, 0.0) + quantity(q)
        for node_name, res in self.workers.gpus().items():
            for k, q in res.items():
                used.setdefault(node_name, {})[k] = used.get(node_name, {}).get(k, 0.0) + q
        return used


def _rfc3339(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
