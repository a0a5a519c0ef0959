"""The keeper at work: start or adopt the worker pod of its slot, watch it, start the next incarnation after an
infrastructure failure, give up after too many crashes; leave for a retry when its own pod is taken away.

The decisions are pure functions in `keeper.py`; a multi-node learner's workers are TrainJobs
(`KubeTrainJobs`, decisions in `trainjob.py`) served in the shape of worker pods, so the loop is the same.
The keeper polls its worker with a GET every `poll_s`, and starts incarnation n+1 only once no earlier worker
of its slot is still being deleted (force-deleted past `stuck_s`). On SIGTERM it force-deletes its own pod
object, so Argo records "pod deleted", which stock KFP retries, and the retried keeper adopts the worker;
when KFP is stopping the run it deletes its worker instead.

Design notes (the SIGTERM window, what stays exposed): docs/internals.md, "The keeper at work".
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from ddiloco.components import trainjob
from ddiloco.components.keeper import (
    CRASH,
    RUNNING,
    SUCCEEDED,
    USAGE,
    Slot,
    WorkerSpec,
    classify,
    pick,
    worker_manifest,
    workflow_stopped,
)
from ddiloco.components.keeper_note import WaitNote, slot_name
from ddiloco.components.podsettings import PodSettings

log = logging.getLogger("ddiloco.keeper")


class KeeperFailed(RuntimeError):
    pass


class KubePods:
    """The few pod (and Workflow) calls the keeper makes, as plain JSON dicts, through the official client."""

    def __init__(self, namespace: str, host: str | None = None) -> None:
        from kubernetes import client, config

        if host:
            conf = client.Configuration()
            conf.host = host
            api = client.ApiClient(conf)
        else:
            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
            api = client.ApiClient()
        self.core, self.custom, self.namespace = (
            client.CoreV1Api(api),
            client.CustomObjectsApi(api),
            namespace,
        )

    def _call(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> dict[str, Any] | None:
        from kubernetes.client.exceptions import ApiException

        try:
            resp = fn(*args, _preload_content=False, _request_timeout=30, **kw)
        except ApiException as e:
            if e.status == 404:
                return None
            raise
        return json.loads(resp.data or b"{}")

    def get(self, name: str) -> dict[str, Any] | None:
        return self._call(self.core.read_namespaced_pod, name, self.namespace)

    def list(self, selector: str) -> list[dict[str, Any]]:
        out = self._call(self.core.list_namespaced_pod, self.namespace, label_selector=selector)
        return (out or {}).get("items") or []

    def create(self, body: dict[str, Any]) -> dict[str, Any] | None:
        from kubernetes.client.exceptions import ApiException

        try:
            return self._call(self.core.create_namespaced_pod, self.namespace, body)
        except ApiException as e:
            if e.status == 409:  # already there: a keeper that died between create and record
                return self.get(body["metadata"]["name"])
            raise

    def delete(self, name: str, grace_s: int | None = None) -> bool:
        kw = {} if grace_s is None else {"grace_period_seconds": grace_s}
        return self._call(self.core.delete_namespaced_pod, name, self.namespace, **kw) is not None

    def retire(self, name: str) -> None:
        """Nothing to do for an ended worker pod: it holds no resources, and its status stays for the record."""

    def workflow(self, name: str) -> dict[str, Any] | None:
        return self._call(
            self.custom.get_namespaced_custom_object,
            "argoproj.io",
            "v1alpha1",
            self.namespace,
            "workflows",
            name,
        )


class KubeTrainJobs:
    """The worker calls of a multi-node learner's keeper, whose workers are TrainJobs: each one is served in the
    shape of a worker pod (`trainjob.as_worker`, from the TrainJob and its node pods)."""

    def __init__(self, pods: KubePods) -> None:
        self.pods = pods
        self.seen: dict[str, dict[str, str]] = {}
        """TrainJob name -> completion index -> uid of the first node pod seen there."""

    def _custom(self, verb: str, *args: Any, **kw: Any) -> dict[str, Any] | None:
        fn = getattr(self.pods.custom, f"{verb}_namespaced_custom_object")
        return self.pods._call(
            fn, trainjob.GROUP, trainjob.VERSION, self.pods.namespace, trainjob.PLURAL, *args, **kw
        )

    def _view(self, job: dict[str, Any]) -> dict[str, Any]:
        name = job["metadata"]["name"]
        nodes = self.pods.list(f"{trainjob.JOBSET_NAME_LABEL}={name}")
        return trainjob.as_worker(job, nodes, self.seen.setdefault(name, {}))

    def get(self, name: str) -> dict[str, Any] | None:
        job = self._custom("get", name)
        return None if job is None else self._view(job)

    def list(self, selector: str) -> list[dict[str, Any]]:
        out = self._custom("list", label_selector=selector)
        return [self._view(job) for job in (out or {}).get("items") or []]

    def create(self, body: dict[str, Any]) -> dict[str, Any] | None:
        from kubernetes.client.exceptions import ApiException

        try:
            return self._custom("create", body)
        except ApiException as e:
            if e.status == 409:  # already there: a keeper that died between create and record
                return self.get(body["metadata"]["name"])
            raise

    def delete(self, name: str, grace_s: int | None = None) -> bool:
        """Delete in the foreground (the TrainJob stays until its pods are gone); grace 0 also force-deletes
        its node pods, as `kubectl delete --force` would on a lost node."""
        if grace_s == 0:
            for pod in self.pods.list(f"{trainjob.JOBSET_NAME_LABEL}={name}"):
                self.pods.delete(pod["metadata"]["name"], 0)
        body = {"propagationPolicy": "Foreground"}
        return self._custom("delete", name, body=body) is not None

    def retire(self, name: str) -> None:
        """An ended TrainJob goes at once: a lost node's peers must not train on (`trainjob`, restarts)."""
        self.delete(name)


class Keeper:
    def __init__(
        self,
        pods: Any,
        slot: Slot,
        spec: WorkerSpec,
        own_name: str,
        *,
        crash_restarts: int,
        infra_restarts: int,
        backoff_s: float,
        poll_s: float = 2.0,
        stuck_s: float = 120.0,
        sleep: Callable[[float], None] = time.sleep,
        workers: Any = None,
        manifest: Callable[[Slot, int, WorkerSpec, dict[str, Any]], dict[str, Any]] = worker_manifest,
        note: Any = None,
    ) -> None:
        """`pods` reads the keeper's own pod and its Workflow; `workers` (default `pods`) creates, reads, lists and
        deletes the workers `manifest` describes: worker pods, or TrainJobs (`KubeTrainJobs`, `trainjob`).
        `note` (a `keeper_note.WaitNote`) tells the run's store while a worker waits to be scheduled."""
        self.pods, self.slot, self.spec, self.own_name = pods, slot, spec, own_name
        self.workers, self.manifest = pods if workers is None else workers, manifest
        self.crash_restarts, self.infra_restarts = crash_restarts, infra_restarts
        self.backoff_s, self.poll_s, self.stuck_s, self.sleep = backoff_s, poll_s, stuck_s, sleep
        self.worker: str | None = None
        self.own: dict[str, Any] | None = None
        self.note = note

    def run(self) -> None:
        """Keep the slot's worker until it succeeds (return) or fails for good (KeeperFailed)."""
        self.own = self.pods.get(self.own_name)
        if self.own is None:
            raise KeeperFailed(
                f"cannot read my own pod {self.own_name!r} (the pod name comes from the downward API)"
            )
        found = pick(self.workers.list(self.slot.selector()))
        crashes, infra, n = found.crashes, found.infra, found.next_incarnation
        if found.done is not None:
            log.info("worker %s already succeeded: nothing to do", found.done["metadata"]["name"])
            return
        if found.ending is not None:
            raise KeeperFailed(f"worker {found.ending['metadata']['name']}: {classify(found.ending).why}")
        if found.adopt is not None:
            self.worker = found.adopt["metadata"]["name"]
            log.info("adopted live worker %s", self.worker)
        while True:
            if self.worker is None:
                self._wait_for_terminating()
                self._create(n)
                n += 1
            ending = self._watch()
            if ending.state == SUCCEEDED:
                log.info("worker %s succeeded", self.worker)
                return
            name, self.worker = self.worker, None
            self.workers.retire(name)
            if ending.state == USAGE:
                raise KeeperFailed(f"worker {name}: {ending.why}")
            if ending.state == CRASH:
                crashes += 1
                if crashes > self.crash_restarts:
                    raise KeeperFailed(
                        f"worker {name} crashed ({ending.why}); {crashes - 1} restarts used of "
                        f"crash_restarts={self.crash_restarts} (its error is in the worker's log)"
                    )
            else:
                infra += 1
                if infra > self.infra_restarts:
                    raise KeeperFailed(
                        f"worker {name} was taken away by the cluster ({ending.why}) for the {infra}th time: "
                        f"more than the limit of {self.infra_restarts}"
                    )
            log.warning(
                "worker %s ended: %s (%s); incarnation %d in %gs",
                name,
                ending.state,
                ending.why,
                n,
                self.backoff_s,
            )
            self.sleep(self.backoff_s)

    def _create(self, n: int) -> None:
        body = self.manifest(self.slot, n, self.spec, self.own or {})
        self.workers.create(body)
        self.worker = body["metadata"]["name"]
        log.info("started worker %s", self.worker)

    def _watch(self) -> Any:
        assert self.worker is not None
        said = ""
        while True:
            pod = self.workers.get(self.worker)
            ending = classify(pod)
            waits = ending.why.removeprefix("Pending: ") if ending.why.startswith("Pending: ") else ""
            if self.note is not None and (ending.state != RUNNING or (ending.why != said and not waits)):
                self.note.clear()  # writes only after a note said it waits
            if ending.state != RUNNING:
                return ending
            if ending.why != said and waits:  # e.g. a Kueue queue without quota
                log.info("worker %s waits: %s", self.worker, waits)
                if self.note is not None:
                    self.note.waiting(self.worker, waits)
            said = ending.why
            self.sleep(self.poll_s)

    def _wait_for_terminating(self) -> None:
        waited = 0.0
        for p in self.workers.list(self.slot.selector()):  # a retried keeper's predecessor may have left one
            if classify(p).state not in (RUNNING, SUCCEEDED):  # ended, not being deleted
                self.workers.retire(p["metadata"]["name"])
        while True:
            going = [
                p["metadata"]["name"]
                for p in self.workers.list(self.slot.selector())
                if classify(p).state == RUNNING and (p.get("metadata") or {}).get("deletionTimestamp")
            ]
            if not going:
                return
            if waited >= self.stuck_s:
                for name in going:
                    log.warning("worker %s still terminating after %gs: force-deleting it", name, waited)
                    self.workers.delete(name, 0)
            self.sleep(self.poll_s)
            waited += self.poll_s

    def on_sigterm(self) -> None:
        """Leave for a retry (module docstring): force-delete the own pod, then clean up if the run stops."""
        try:
            self.pods.delete(self.own_name, 0)
        except Exception:  # noqa: BLE001 (nothing else can be done in the window; the log says what)
            log.exception("could not delete my own pod %s", self.own_name)
        labels = ((self.own or {}).get("metadata") or {}).get("labels") or {}
        workflow_name = labels.get("workflows.argoproj.io/workflow", "")
        try:
            stopping = (
                workflow_stopped(self.pods.workflow(workflow_name), time.time()) if workflow_name else False
            )
        except Exception:  # noqa: BLE001
            log.exception("could not read workflow %s", workflow_name)
            stopping = False
        if stopping and self.worker:
            log.warning("the run is being stopped: deleting worker %s", self.worker)
            self.workers.delete(self.worker)


def keep(keeper: Keeper) -> None:
    """Run a keeper with its SIGTERM handler installed (exit 143 after the handler)."""

    def handler(signum: int, frame: Any) -> None:
        keeper.on_sigterm()
        sys.stderr.flush()
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, handler)
    keeper.run()


def worker_env(
    secret_env: dict[str, str], store_secret: str, s3_endpoint: str, run_key: dict[str, Any] | None
) -> list[dict[str, Any]]:
    """The worker's env as the task pod has it today: store credentials from the store Secret (optional: without
    it the store takes the AWS credential chain, e.g. the web identity of `pod_settings.service_account`), the
    optional run key, the namespace and the pod's own name from the downward API, the S3 endpoint."""
    from ddiloco.components.runtime import NAMESPACE_ENV

    from ddiloco.platform.hostname import POD_NAME_ENV

    env: list[dict[str, Any]] = [
        {"name": var, "valueFrom": {"secretKeyRef": {"name": store_secret, "key": key, "optional": True}}}
        for key, var in secret_env.items()
    ]
    if run_key:  # {"secret", "entries": {secret key: variable}} (a learner's share, or the master key)
        entries = run_key.get("entries") or {run_key["key"]: run_key["env"]}
        for key, var in entries.items():
            ref = {"name": run_key["secret"], "key": key, "optional": True}
            env.append({"name": var, "valueFrom": {"secretKeyRef": ref}})
    env += [
        {"name": NAMESPACE_ENV, "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": POD_NAME_ENV, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
    ]
    if s3_endpoint:
        env.append({"name": "DDILOCO_S3_ENDPOINT", "value": s3_endpoint})
    return env


def keep_role(
    role: str,
    store_root: str,
    run_id: str,
    worker: dict[str, Any],
    *,
    learner_id: int | None = None,
    flags: dict[str, Any] | None = None,
    s3_endpoint: str = "",
    store_secret: str = "",
    node_selector: dict[str, str] | None = None,
    tolerations: list[dict[str, Any]] | None = None,
    crash_restarts: int = 0,
    kueue_queue: str = "",
    pod_settings: dict[str, Any] | None = None,
) -> None:
    """A keeper task's body: keep `ddiloco ROLE --store ROOT [--learner-id N] FLAGS` running in a worker pod, or
    in a TrainJob of `worker["nodes"]` pods of `worker["procs_per_node"]` ranks each when nodes > 1.
    `worker` is the compile-time part (image, resources, limits, backoff), the rest comes from the run."""
    from ddiloco.components.runtime import NAMESPACE_ENV, command, open_run_store

    from ddiloco.platform.hostname import POD_NAME_ENV

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cmd = command(role, store=store_root, learner_id=learner_id, **(flags or {}))
    spec = WorkerSpec(
        image=worker["image"],
        command=["python3", *cmd[1:]],
        env=worker_env(worker["secret_env"], store_secret, s3_endpoint, worker.get("run_key")),
        requests=worker.get("requests", {}),
        limits=worker.get("limits", {}),
        node_selector=dict(node_selector or {}),
        tolerations=list(tolerations or []),
        shm=worker.get("shm", ""),
        settings=PodSettings.of(kueue_queue, pod_settings),
    )
    own, namespace = os.environ.get(POD_NAME_ENV, ""), os.environ.get(NAMESPACE_ENV, "")
    if not own or not namespace:
        raise ValueError(
            f"the keeper needs {POD_NAME_ENV} and {NAMESPACE_ENV} (the pipeline sets them from the downward API)"
        )
    pods, nodes = KubePods(namespace), int(worker.get("nodes", 1))
    workers: dict[str, Any] = {}
    if nodes > 1:  # one learner over several pods: a TrainJob (`trainjob`)
        procs = int(worker["procs_per_node"])
        if spec.settings.priority_class:
            log.warning(
                "pod_settings.priority_class %r does not reach a TrainJob's node pods (the runtime sets "
                "theirs; docs/cluster.md, Your cluster)",
                spec.settings.priority_class,
            )
        workers["workers"] = KubeTrainJobs(pods)
        workers["manifest"] = partial(trainjob.trainjob_manifest, nodes=nodes, procs_per_node=procs)
    keeper = Keeper(
        pods,
        Slot(role, run_id, learner_id),
        spec,
        own,
        crash_restarts=crash_restarts,
        infra_restarts=int(worker["infra_restarts"]),
        backoff_s=float(worker["backoff_s"]),
        poll_s=float(worker.get("poll_s", 2.0)),
        note=WaitNote(partial(open_run_store, store_root, s3_endpoint), slot_name(role, learner_id)),
        **workers,
    )
    keep(keeper)
