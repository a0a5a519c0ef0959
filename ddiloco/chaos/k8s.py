"""The `chaos` role: fire a run's timed chaos schedule at its learner and syncer pods (or processes).

This is what the pipeline's chaos step runs next to the learners and the syncer; `ddiloco run` keeps its own
in-process backend (`chaos.LocalChaos`), which also restarts what it kills.

Design choices:
- Same schedule, same clock as the local backend: `chaos.schedule_from_config(config.chaos, learners)`, with
  `at_s` counted from `prepared_at` in `data/meta.json` (the start of this step if that field is missing).
- Who is a victim: learner i's pod (or process) is named by its newest report (`host`, `pid`), the syncer's by
  `syncer/status.json` (`syncer_host`, `syncer_pid`). A name read from the store is never trusted alone: on
  Kubernetes a pod is deleted only if it is in the list the API returns for the role label selector *and*
  this run's Argo workflow label, and the labels are checked again on our side. Nothing else is touched.
- A kill is a delete with grace period 0 (the pod gets SIGKILL, like a node loss). Argo marks the node
  `Error`; the retry that brings the learner back needs the workflow-controller setting in `manifests/`.
- What each backend cannot do is skipped with a record saying so (Kubernetes: stalls and added learners);
  `at_step` kills, slow learners and store outages are fired by the learner/syncer processes themselves.
- Every fired or skipped event is recorded once under `chaos/{backend}/{id}.json` (so a retried chaos step
  never fires an event twice, and `summary.json` lists them with the rest of the run's chaos events).
- The step ends when `done.json` appears, or when nothing is left to fire.
- `local` backend: SIGKILL by pid, only on this host and only for a process whose command line is the
  expected `ddiloco learner|syncer` role on this store (pids are reused; a stale report must not kill a
  stranger).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from ddiloco import keys
from ddiloco.chaos.local import ChaosEvent, schedule_from_config
from ddiloco.config import RunConfig
from ddiloco.hostname import host_name
from ddiloco.store import Store, StoreError, open_store

log = logging.getLogger(__name__)

ROLE_LABEL = "ddiloco.io/role"
WORKFLOW_LABEL = "workflows.argoproj.io/workflow"
DEFAULT_SELECTOR = f"{ROLE_LABEL} in (learner,syncer)"
SA_NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"

TIMED_KILLS = ("kill_learner", "kill_syncer")
SELF_FIRED = "fired by the learner/syncer process itself"


class ChaosBackendError(ValueError):
    """The backend cannot work (no namespace, no permission to list pods, ...); the message says what to fix.
    A ValueError so that the CLI prints it as one line with exit code 2."""


def record_key(backend: str, event_id: str) -> str:
    return f"chaos/{backend}/{event_id}.json"


# --- who is the victim ---------------------------------------------------------------------------------------
def newest_report(store: Store, learner_id: int) -> dict[str, Any] | None:
    """The newest incarnation's report of a learner (keys are zero-padded, so the largest key is newest)."""
    found = [k for k in store.list(keys.learner_prefix(learner_id)) if k.endswith("/report.json")]
    return store.get_json_or_none(max(found)) if found else None


def victim_of(store: Store, ev: ChaosEvent) -> tuple[str, int | None] | None:
    """(host, pid) of the process an event targets, from the store; None when it has not reported yet."""
    if ev.kind == "kill_syncer":
        status = store.get_json_or_none(keys.STATUS)
        return (
            (status["syncer_host"], status.get("syncer_pid"))
            if status and status.get("syncer_host")
            else None
        )
    report = newest_report(store, ev.learner)  # type: ignore[arg-type]
    if report is None or not report.get("host") or report.get("final"):
        return None  # not started, or its newest incarnation already exited
    return report["host"], report.get("pid")


# --- backends ----------------------------------------------------------------------------------------------
class Backend(Protocol):
    name: str

    def kill(self, role: str, host: str, pid: int | None) -> dict[str, Any] | None:
        """Kill the victim; return what was done, or None if it is not (or not yet) a target we may kill."""


class KubernetesPods:
    """Deletes pods of one Argo workflow through the Kubernetes API (the official client, imported lazily)."""

    name = "k8s"

    def __init__(self, api: Any, namespace: str, workflow: str, selector: str = DEFAULT_SELECTOR) -> None:
        if not workflow:
            raise ChaosBackendError(
                "the kubernetes backend needs the run's workflow name: pass --workflow or set "
                "DDILOCO_K8S_WORKFLOW (the pipeline sets it from the pod label " + WORKFLOW_LABEL + ")"
            )
        self.api, self.namespace, self.workflow = api, namespace, workflow
        self.selector = f"{selector},{WORKFLOW_LABEL}={workflow}"

    @classmethod
    def connect(
        cls, namespace: str, workflow: str, selector: str = DEFAULT_SELECTOR, host: str | None = None
    ) -> KubernetesPods:
        """In-cluster service account first, then ~/.kube/config; `host` talks to that API URL unauthenticated."""
        from kubernetes import client, config

        if host:
            conf = client.Configuration()
            conf.host = host
            return cls(client.CoreV1Api(client.ApiClient(conf)), namespace, workflow, selector)
        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        return cls(client.CoreV1Api(), namespace, workflow, selector)

    def pods(self) -> dict[str, str]:
        """Live pods of this run that the selector names: pod name -> role label."""
        from kubernetes.client.exceptions import ApiException

        try:
            listed = self.api.list_namespaced_pod(
                self.namespace, label_selector=self.selector, _request_timeout=30
            )
        except ApiException as e:
            raise ChaosBackendError(
                f"cannot list pods in namespace {self.namespace!r} (HTTP {e.status} {e.reason}): the chaos step's "
                "service account needs list/delete on pods there (manifests/base/chaos-rbac.yaml)"
            ) from None
        out = {}
        for pod in listed.items:
            labels = pod.metadata.labels or {}
            phase = pod.status.phase if pod.status is not None else None
            # Checked again here: a victim must carry this run's workflow label whatever the API returned.
            if labels.get(WORKFLOW_LABEL) != self.workflow or pod.metadata.deletion_timestamp is not None:
                continue
            if phase in ("Succeeded", "Failed") or labels.get(ROLE_LABEL) not in ("learner", "syncer"):
                continue
            out[pod.metadata.name] = labels[ROLE_LABEL]
        return out

    def kill(self, role: str, host: str, pid: int | None) -> dict[str, Any] | None:
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        if self.pods().get(host) != role:
            return None  # not (yet) a live pod of this run with that role
        try:
            self.api.delete_namespaced_pod(
                host, self.namespace, grace_period_seconds=0,
                body=client.V1DeleteOptions(grace_period_seconds=0), _request_timeout=30,
            )  # fmt: skip
        except ApiException as e:
            if e.status == 404:
                return {"action": "skipped (pod already gone)", "pod": host}
            raise ChaosBackendError(
                f"cannot delete pod {host!r} in {self.namespace!r} (HTTP {e.status} {e.reason}): grant the chaos "
                "step's service account delete on pods (manifests/base/chaos-rbac.yaml)"
            ) from None
        return {
            "action": "deleted pod", "pod": host, "namespace": self.namespace, "workflow": self.workflow,
            "grace_period_s": 0,
        }  # fmt: skip


class LocalProcesses:
    """SIGKILL by pid for roles started by hand on this machine (`ddiloco learner|syncer --store URL`)."""

    name = "local"

    def __init__(self, store_url: str, proc_root: str = "/proc") -> None:
        self.store_url, self.proc_root, self.hostname = store_url, Path(proc_root), host_name()

    def _cmdline(self, pid: int) -> list[str]:
        try:
            return (self.proc_root / str(pid) / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            return []

    def kill(self, role: str, host: str, pid: int | None) -> dict[str, Any] | None:
        if host != self.hostname or pid is None:
            return None
        argv = self._cmdline(pid)
        if role not in argv or self.store_url not in argv or not any("ddiloco" in a for a in argv):
            return None  # exited, or the pid now belongs to another process
        os.kill(pid, signal.SIGKILL)
        return {"action": "SIGKILL", "pid": pid, "host": host}


# --- the driver --------------------------------------------------------------------------------------------
class ChaosRole:
    """Fires the due events of a schedule through a backend and records each one in the store."""

    def __init__(
        self,
        store: Store,
        backend: Backend,
        events: Sequence[ChaosEvent],
        t0: float,
        *,
        victim_wait_s: float = 120.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store, self.backend, self.t0, self.clock = store, backend, t0, clock
        self.victim_wait_s = victim_wait_s
        self.records: list[dict[str, Any]] = []
        self.pending: list[ChaosEvent] = []
        for ev in events:
            if self.store.exists(record_key(backend.name, ev.id)):
                continue  # a retried chaos step: this event was handled by an earlier attempt
            if ev.kind in TIMED_KILLS and ev.at_s is not None:
                self.pending.append(ev)
            elif ev.kind in ("stall_learner", "add_learner"):
                how = (
                    "pods cannot be paused"
                    if ev.kind == "stall_learner"
                    else "the pipeline starts its learners"
                )
                self._record(ev, self.clock(), action=f"skipped (not possible on Kubernetes: {how})")
            else:
                log.info("chaos: %s (%s) is %s", ev.id, ev.kind, SELF_FIRED)
        self.pending.sort(key=lambda e: e.at_s)  # type: ignore[arg-type,return-value]

    def poll(self) -> None:
        now = self.clock()
        for ev in [e for e in self.pending if now >= self.t0 + e.at_s]:  # type: ignore[operator]
            role = "syncer" if ev.kind == "kill_syncer" else "learner"
            victim = victim_of(self.store, ev)
            detail = self.backend.kill(role, *victim) if victim is not None else None
            if detail is None:
                if now < self.t0 + ev.at_s + self.victim_wait_s:  # type: ignore[operator]
                    continue  # not running yet (pending pod, no report): try again at the next poll
                who = f"learner {ev.learner}" if role == "learner" else "the syncer"
                detail = {
                    "action": f"skipped (no live {role} to kill: {who} not found within {self.victim_wait_s:.0f}s)"
                }
            self.pending.remove(ev)
            self._record(ev, now, **detail)
            log.warning("chaos: %s at %.1fs: %s", ev.id, now - self.t0, detail["action"])

    def run(
        self,
        poll_s: float = 1.0,
        max_seconds: float | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> list[dict[str, Any]]:
        """Poll until `done.json` appears, nothing is left to fire, or `max_seconds` passed."""
        start = self.clock()
        while self.pending:
            try:
                if self.store.exists(keys.DONE):
                    break
                self.poll()
            except StoreError as e:  # the store is away (maybe an injected outage): keep the schedule
                log.warning("chaos: store unavailable (%s); retrying", e)
            if max_seconds is not None and self.clock() - start >= max_seconds:
                break
            if self.pending:
                sleep(poll_s)
        for ev in self.pending:
            log.info("chaos: %s not fired (run ended first)", ev.id)
        return self.records

    def _record(self, ev: ChaosEvent, now: float, **detail: Any) -> None:
        rec = {
            **ev.to_json(),
            "backend": self.backend.name,
            "time_s": round(now - self.t0, 3),
            "fired_at": now,
            **detail,
        }
        self.store.put_json(record_key(self.backend.name, ev.id), rec)
        self.records.append(rec)


def markdown_table(records: Sequence[dict[str, Any]]) -> str:
    """What the chaos step did, for the KFP UI (a Markdown artifact)."""
    lines = ["# Chaos events", "", "| id | kind | target | at (s) | action |", "|---|---|---|---|---|"]
    for r in records:
        target = r.get("pod") or (f"pid {r['pid']}" if "pid" in r else "")
        who = (
            f"learner {r['learner']}"
            if r.get("learner") is not None
            else ("syncer" if r["kind"] == "kill_syncer" else "")
        )
        lines.append(f"| {r['id']} | {r['kind']} | {who} {target} | {r['time_s']:.1f} | {r['action']} |")
    if not records:
        lines.append("| | | | | nothing fired |")
    return "\n".join(lines) + "\n"


# --- command line --------------------------------------------------------------------------------------------
def _namespace(arg: str | None) -> str:
    ns = arg or os.environ.get("DDILOCO_K8S_NAMESPACE")
    if not ns and os.path.isfile(SA_NAMESPACE_FILE):
        ns = Path(SA_NAMESPACE_FILE).read_text().strip()
    if not ns:
        raise ChaosBackendError("no namespace: pass --namespace or set DDILOCO_K8S_NAMESPACE")
    return ns


def cmd_chaos(args: argparse.Namespace) -> int:
    store = open_store(args.store)
    cfg = RunConfig.from_dict(store.get_json(keys.CONFIG))
    meta = store.get_json_or_none(keys.DATA_META) or {}
    t0 = float(meta.get("prepared_at") or time.time())
    events = schedule_from_config(cfg.chaos, cfg.diloco.learners)
    if args.backend == "kubernetes":
        workflow = args.workflow or os.environ.get("DDILOCO_K8S_WORKFLOW", "")
        backend: Backend = KubernetesPods.connect(
            _namespace(args.namespace), workflow, args.selector, args.kube_api
        )
    else:
        backend = LocalProcesses(args.store)
    role = ChaosRole(store, backend, events, t0, victim_wait_s=args.victim_wait)
    records = role.run(poll_s=args.poll_seconds, max_seconds=args.max_seconds)
    if args.markdown_out:
        Path(args.markdown_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown_out).write_text(markdown_table(records))
    log.info("chaos: %d event(s) recorded under chaos/%s/", len(records), backend.name)
    return 0


def register(subparsers: Any) -> None:
    """Add `ddiloco chaos` to the CLI."""
    p = subparsers.add_parser(
        "chaos", help="fire the run's timed chaos schedule at its learner/syncer pods (or local processes)"
    )
    p.add_argument("--store", required=True, help="run root, e.g. s3://bucket/prefix/run")
    p.add_argument("--backend", choices=["kubernetes", "local"], default="kubernetes")
    p.add_argument("--namespace", help="pods' namespace (default $DDILOCO_K8S_NAMESPACE, else this pod's)")
    p.add_argument(
        "--workflow",
        help=f"this run's Argo workflow (default $DDILOCO_K8S_WORKFLOW); pods need {WORKFLOW_LABEL}",
    )
    p.add_argument(
        "--selector", default=DEFAULT_SELECTOR, help=f"victims' label selector (default {DEFAULT_SELECTOR!r})"
    )
    p.add_argument("--poll-seconds", type=float, default=1.0, help="seconds between checks of the schedule")
    p.add_argument(
        "--victim-wait",
        type=float,
        default=120.0,
        help="seconds to wait for a victim to be running before skipping",
    )
    p.add_argument("--max-seconds", type=float, default=None, help="give up after this many seconds")
    p.add_argument("--markdown-out", metavar="PATH", help="also write what happened as a Markdown table")
    p.add_argument("--kube-api", metavar="URL", help="talk to this API server URL (kubectl proxy, tests)")
    p.set_defaults(func=cmd_chaos)
