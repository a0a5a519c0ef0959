"""A KFP container task in the twin: its driver, its pods (one per Argo retry attempt), their end, retries.

Design choices:
- The driver runs once per task (resolve inputs, executor input, pod spec), every attempt is a new pod with
  a new name and a fresh scratch dir (the pod's /tmp and /minio emptyDirs).
- An attempt is Pending until it is scheduled and its env can be built, Running while its process lives,
  then Succeeded / Failed / Error. Pending forever is not waited for: see `Twin.pending_timeout_s`.
- The env of a pod: the "image" env (pods.base_env + `Twin(env=...)`), then the pod spec's env (KFP + secrets
  + downward API), then what the runtime and Argo add (HOSTNAME, ARGO_*); plus KUBECONFIG for the API
  stand-in (a deviation: real pods use their service account) and the twin's process markers.

Rules and their sources (besides those in launcher.py, platform.py, cluster.py, argo.py):
- KFP launcher_v2.go + cmd/launcher-v2/main.go: a component that exits non-zero fails the launcher, which
  exits 1 (glog.Exit): Argo's message is "main: Error (exit code 1)" (operator.go inferFailedReason). The
  record keeps the component's own exit status in `exit_code`.
- Kubernetes activeDeadlineSeconds (counted from the pod's start): the pod is killed and Failed with
  "Pod was active on the node longer than the specified deadline" (Argo uses the pod's message).
- Argo executor.go monitorDeadline: at the executionDeadline (ARGO_DEADLINE) the main container is killed:
  "Step exceeded its deadline".
- Argo operator.go podReconciliation: a pod that disappears (deleted) marks its node Error "pod deleted".
- What the cluster does to a running pod (preemption, eviction, OOM kill, an admission error, a drain) and
  how Argo classifies it: failures.py; `inject` applies one to a running pod.
- Argo exec_control.go applyExecutionControl: after the workflow deadline (KFP terminate) running and pending
  non-on-exit pods get SIGTERM, SIGKILL after the grace period (pod/queue.go signalContainers, default 30 s),
  and their nodes are Failed "Step exceeded its deadline" at once.
"""

from __future__ import annotations

import os
import shutil
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tests.twin.argo import (
    AttemptView,
    effective_retry_strategy,
    kfp_retry_strategy,
    node_id,
    pod_name,
    retry_decision,
)
from tests.twin.cluster import PodPending, container_env, expand, pod_hostname, schedule
from tests.twin.dag import DEADLINE_MSG, TaskNode
from tests.twin.failures import FAILED, KINDS, FailureKind, failure_kind, signal_exit_code
from tests.twin.identity import identity_env
from tests.twin.ir import TwinUnsupported
from tests.twin.launcher import (
    LauncherError,
    collect_outputs,
    compile_cmd_and_args,
    driver_resolve_args,
    executor_input,
    provision_outputs,
    with_defaults,
    with_retry_index,
)
from tests.twin.platform import build_pod_spec, impl_template_name
from tests.twin.pods import SITE_DIR, PodProcess, base_env
from tests.twin.records import AttemptRecord
from tests.twin.resolve import ResolveError, resolve_inputs

WORKFLOW_LABEL = "workflows.argoproj.io/workflow"
COMPLETED_LABEL = "workflows.argoproj.io/completed"
ON_EXIT_LABEL = "workflows.argoproj.io/on-exit"


def _safe(key: str) -> str:
    return key.replace("/", "__")


class ContainerMixin:
    """Container tasks; mixed into engine.TwinExecution (which provides the clock, the cluster, ...)."""

    def _start_container(self, node: TaskNode) -> None:
        dag, name = node.dag, node.record.name
        try:
            values = resolve_inputs(node.task, node.component, dag, self.run_ctx, name)
            container = self.ir.container(node.component)
            if not container.get("command"):
                raise TwinUnsupported(
                    f"task {node.record.key}: a container without a command (image ENTRYPOINT)"
                )
            k8s = self.ir.k8s_config(node.component)
            pod_tmp = self.work_dir / "tasks" / _safe(node.record.key) / "tmp"
            outputs = provision_outputs(node.component, self.pipeline_root, name, pod_tmp, self.publish_logs)
            ex = executor_input(values, self._input_artifacts(node), outputs)
            argv = driver_resolve_args([*container["command"], *container.get("args", [])], ex)
            pod = build_pod_spec(
                container, k8s, ex, dag, self.run_ctx, name, argv, "retryPolicy" in node.task
            )
            strategy = effective_retry_strategy(kfp_retry_strategy(node.task), self.workflow_defaults)
        except TwinUnsupported:
            raise
        except (ResolveError, LauncherError, ValueError) as e:
            self._finish(node, "Failed", f"driver: {e}", f"driver failed: {e}")
            return
        node.record.inputs, node.record.executor_input, node.record.retry_strategy = values, ex, strategy
        node.state.update(
            ex=ex,
            pod=pod,
            strategy=strategy,
            template=impl_template_name(node.task, node.component, k8s),
            pod_tmp=pod_tmp,
            task_root=Path(outputs["outputFile"]).parent,
            exec_deadline=None,
        )
        self._new_attempt(node)

    def _input_artifacts(self, node: TaskNode) -> dict[str, Any]:
        out = {}
        for name, spec in node.task.get("inputs", {}).get("artifacts", {}).items():
            t = spec.get("taskOutputArtifact")
            producer = node.dag.nodes.get(t["producerTask"]) if t else None
            if producer is None or producer.record.kind != "container":
                raise TwinUnsupported(
                    f"input artifact {name!r} of {node.record.key}: "
                    "only a container task's output is modelled"
                )
            art = producer.record.artifacts.get(t["outputArtifactKey"])
            if art is None:
                raise ResolveError(
                    f"cannot find output artifact key {t['outputArtifactKey']!r} "
                    f"in producer task {t['producerTask']!r}"
                )
            out[name] = {"artifacts": [art]}
        return out

    def _new_attempt(self, node: TaskNode) -> None:
        i = len(node.record.attempts) - node.state.get("attempt_base", 0)  # this executor DAG attempt's
        exec_node = f"{node.argo_name}.executor"
        node_name = f"{exec_node}({i})" if node.state["strategy"] else exec_node
        pod = pod_name(self.workflow, node_name, node.state["template"])
        labels = {**node.state["pod"].labels, WORKFLOW_LABEL: self.workflow, COMPLETED_LABEL: "false"}
        if node.record.on_exit:
            labels[ON_EXIT_LABEL] = "true"
        a = AttemptRecord(
            index=i,
            node_name=node_name,
            pod_name=pod,
            hostname=pod_hostname(pod),
            log=self.work_dir / "pods" / pod / "pod.log",
            created_real=self.now_real(),
            created_cluster=self.now_cluster(),
            labels=labels,
            execution_deadline_cluster=node.state["exec_deadline"],
        )
        node.record.attempts.append(a)
        a.uid = str(uuid.uuid4())
        node.state.update(
            step="pending",
            pending_since=self.now_real(),
            uid=a.uid,
            proc=None,
            killing=None,
            failure=None,
        )
        self.pods[pod] = (node, a)

    def _advance_container(self, node: TaskNode) -> None:
        step, a = node.state.get("step"), node.record.attempts[-1]
        if step == "pending":
            self._try_launch(node, a)
        elif step == "running":
            self._poll(node, a)
        waited = step == "waiting" and (self.terminated or self.now_cluster() >= node.state["until"])
        if (
            node.state.get("step") == "ended" or waited
        ):  # Argo requeues at the backoff's end, or at the deadline
            self._decide(node)

    def _end(self, node: TaskNode, a: AttemptRecord, phase: str, message: str, reason: str = "") -> None:
        a.phase, a.message, a.reason = phase, message, reason or message
        a.finished_real, a.finished_cluster = self.now_real(), self.now_cluster()
        a.labels[COMPLETED_LABEL] = "true"
        node.state["step"] = "ended"

    def _try_launch(self, node: TaskNode, a: AttemptRecord) -> None:
        if self.terminated and not node.record.on_exit:
            self._end(node, a, "Failed", DEADLINE_MSG, "pending pod deleted: the run was terminated")
            return
        pod, ns = node.state["pod"], self.cluster.namespace
        meta = {
            "name": a.pod_name,
            "namespace": ns,
            "uid": node.state["uid"],
            "labels": a.labels,
            "annotations": pod.annotations,
            "service_account": self.cluster.service_account,
        }
        try:
            meta["node"] = schedule(pod, self.cluster.nodes, self._gpus_in_use()).name
            pod_env = identity_env(self.cluster.web_identities, self.cluster.service_account)
            pod_env.update(container_env(pod.env, meta, self.cluster.secrets))
        except PodPending as p:
            a.message, a.reason = p.message, p.reason
            waited = self.now_real() - node.state["pending_since"]
            if p.permanent and waited >= self.pending_timeout_s:
                why = (
                    f"twin: pod Pending for {waited:.1f}s ({p.reason}: {p.message}); "
                    "a real cluster leaves it "
                    "Pending (the run hangs until a deadline)"
                )
                a.finished_real, a.finished_cluster = self.now_real(), self.now_cluster()
                node.state["step"] = "stuck"
                self._finish(node, "Failed", f"pod {a.pod_name} stuck Pending: {p.reason}: {p.message}", why)
            return
        except ValueError as e:  # the API server refuses the pod: Argo marks the node Error
            self._end(node, a, "Error", str(e))
            return
        if node.state.pop("admission_error", False):  # the kubelet rejects it: no container runs
            k = KINDS["admission"]
            a.node, a.status_reason, a.status_message = meta["node"], k.pod_reason, k.pod_message
            self._end(node, a, FAILED, k.argo_message(None), f"rejected at admission: {k.pod_reason}")
            return
        retry_index = str(a.index) if node.state["strategy"] else "0"
        pod_env = {k: v.replace("{{retries}}", str(a.index)) for k, v in pod_env.items()}
        argv = [expand(x, pod_env) for x in pod.command]
        ex = with_retry_index(node.state["ex"], retry_index)
        argv = compile_cmd_and_args(with_defaults(ex, node.component), argv[0], argv[1:])
        pod_dir = self.work_dir / "pods" / a.pod_name
        for d in (node.state["pod_tmp"], node.state["task_root"]):
            shutil.rmtree(d, ignore_errors=True)
        for d in (node.state["pod_tmp"] / "kfp" / "outputs", node.state["task_root"], pod_dir / "tmp"):
            d.mkdir(parents=True, exist_ok=True)
        deadline = a.execution_deadline_cluster
        argo_deadline = (
            datetime.fromtimestamp(self.t0_wall + deadline / self.time_scale, UTC).strftime(
                "%Y-%m-%dT%H:%M:%SZ"
            )
            if deadline is not None
            else "0001-01-01T00:00:00Z"
        )
        env = {
            **base_env(self.python_bin),
            **self.extra_env,
            "KUBECONFIG": str(self.kubeconfig),
            **pod_env,
            "HOSTNAME": a.hostname,
            "TWIN_POD_HOSTNAME": a.hostname,
            "TMPDIR": str(pod_dir / "tmp"),
            "ARGO_CONTAINER_NAME": "main",
            "ARGO_NODE_ID": node_id(self.workflow, a.node_name),
            "ARGO_INCLUDE_SCRIPT_OUTPUT": "false",
            "ARGO_DEADLINE": argo_deadline,
            "TWIN_POD_UID": node.state["uid"],
            "TWIN_RUN_ID": self.record.run_id,
        }
        if env["PYTHONPATH"] != str(SITE_DIR):  # an env that sets PYTHONPATH keeps the hostname stand-in
            env["PYTHONPATH"] = os.pathsep.join([str(SITE_DIR), env["PYTHONPATH"]])
        a.env, a.argv, a.node = env, argv, meta["node"]
        node.state["proc"] = PodProcess(argv, env, pod_dir, a.log, emissary=True)
        a.phase, a.started_real, a.started_cluster = "Running", self.now_real(), self.now_cluster()
        node.state["step"] = "running"

    def _poll(self, node: TaskNode, a: AttemptRecord) -> None:
        proc: PodProcess = node.state["proc"]
        rc = proc.poll()
        if rc is None:
            ads = node.state["pod"].active_deadline_seconds
            if (
                node.state["killing"] is None
                and ads
                and self.now_real() - a.started_real >= ads / self.time_scale
            ):
                node.state["killing"] = (
                    "Failed",
                    "Pod was active on the node longer than the specified deadline",
                    f"DeadlineExceeded: activeDeadlineSeconds {ads} (cluster seconds) passed",
                )
                proc.terminate(self.grace_real)
            ed = a.execution_deadline_cluster
            if node.state["killing"] is None and ed is not None and self.now_cluster() >= ed:
                node.state["killing"] = (
                    "Failed",
                    DEADLINE_MSG,
                    "Argo executionDeadline (first attempt's start + "
                    "retry maxDuration) passed: main container killed",
                )
                proc.terminate(self.grace_real)
            return
        a.exit_code = rc
        if node.state.get("failure") is not None:
            self._end_failure(node, a, node.state["failure"], rc)
        elif node.state["killing"] is not None:
            self._end(node, a, *node.state["killing"])
        elif rc == 0:
            try:
                node.record.outputs, node.record.artifacts = collect_outputs(
                    node.state["ex"], node.component, self.pipeline_root
                )
                self._end(node, a, "Succeeded", "")
            except LauncherError as e:
                self._end(node, a, "Failed", "main: Error (exit code 1)", f"launcher: {e}")
        else:
            self._end(node, a, "Failed", "main: Error (exit code 1)", f"component exited with {rc}")

    def inject(self, pod: str, kind: str) -> None:
        """Apply a failure kind (failures.KINDS) to a running pod, as the cluster would. `admission`
        force-deletes the pod and has the kubelet reject the retry's pod at admission (kubernetes#130145)."""
        k = failure_kind(kind)
        with self.lock:
            if pod in self.workers.pods:
                self.workers.inject(pod, kind)
                return
            node, a = self.pods.get(pod, (None, None))
            proc = node.state.get("proc") if node is not None and node.record.attempts[-1] is a else None
            if proc is None or proc.returncode is not None or a.done or pod in self.deleted:
                raise ValueError(f"pod {pod!r} is not a running pod of this run")
            if k.name == "admission":
                node.state["admission_error"] = True
                self.delete_pod(self.cluster.namespace, pod, 0)
                return
            node.state["failure"] = k
            if k.graceful:
                proc.terminate(self.grace_real)
                return
            proc.kill()
            self._end_failure(node, a, k, proc.returncode)

    def _end_failure(self, node: TaskNode, a: AttemptRecord, k: FailureKind, rc: int | None) -> None:
        code = 137 if k.container_reason == "OOMKilled" else signal_exit_code(rc)
        a.exit_code, a.status_reason, a.status_message = code, k.pod_reason, k.pod_message
        node.state["failure"] = None
        self._end(node, a, FAILED, k.argo_message(code), f"{k.name}: the cluster ended the pod")
        if not k.pod_stays:
            self.deleted.add(a.pod_name)

    def _decide(self, node: TaskNode) -> None:
        strategy, last = node.state["strategy"], node.record.attempts[-1]
        if strategy is None:
            node.state["step"] = "done"
            self._finish(node, last.phase, last.message, last.reason)
            return
        views = [
            AttemptView(x.phase, x.message, x.created_cluster, x.finished_cluster or x.created_cluster)
            for x in node.record.attempts[node.state.get("attempt_base", 0) :]
        ]
        d = retry_decision(
            strategy,
            views,
            self.now_cluster(),
            deadline_exceeded=self.terminated,
            transient_pattern=self.transient_error_pattern,
        )
        if d.action == "wait":
            node.state.update(step="waiting", until=d.until)
            node.record.reason = d.message
        elif d.action == "retry":
            node.state["exec_deadline"] = d.execution_deadline
            self._new_attempt(node)
        else:
            node.state["step"] = "done"
            self._finish(node, d.phase, d.message, d.reason or d.message)
