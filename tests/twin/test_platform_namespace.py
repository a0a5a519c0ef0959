"""The keeper's workers and a multi-node learner's TrainJob in a platform team's namespace, through the twin (a
stand-in: tests/twin/admission.py, kueue.py): labelled for Istio injection, enforcing Pod Security
`restricted`, under a Kueue queue. The real keeper loop and manifests (`_keeper_harness`) against the API
stand-in; each test bounds how long a keeper may watch, so a worker stuck Running or a workload never
admitted fails it instead of hanging."""

# No `from __future__ import annotations`: kfp reads the components' annotations at definition time.
import time

import pytest
from ddiloco.components.keeper import Slot, WorkerSpec, worker_manifest
from ddiloco.components.keeper_note import WaitNote
from ddiloco.components.podsettings import PodSettings

from ddiloco.posttrain.summary import keeper_waits
from ddiloco.store.url import open_store
from tests.twin import KFP_2_17, Cluster, Twin
from tests.twin._keeper_harness import KeeperThread, owner
from tests.twin.admission import pod_security
from tests.unit.test_keeper import KEEPER_POD

pytestmark = [pytest.mark.twin, pytest.mark.slow]
NAMESPACE = "team-a"
ISTIO = {"istio-injection": "enabled"}  # the Kubeflow profile controller's label on a profile namespace
RESTRICTED = {"pod-security.kubernetes.io/enforce": "restricted"}
WORKER_S, TRAINJOB_S = 30.0, 120.0
"""How long a keeper may take: a worker prints one line; two torchrun nodes import torch on a loaded machine."""


def _twin(compile_pipeline, tmp_path, **cluster) -> Twin:
    return Twin(
        compile_pipeline(owner), tmp_path, cluster=Cluster(namespace=NAMESPACE, **cluster),
        workflow_defaults=KFP_2_17, time_scale=60, timeout_s=400,
    )  # fmt: skip


def _keep(twin: Twin, kind: str, settings: PodSettings | None = None, during=None, note=None):
    """Start the twin, run a keeper of `kind` ("pod" or "trainjob") with `note` (keeper_note.WaitNote);
    `during(ex, keeper)` runs while it keeps. Returns (outcome, keeper, created pods' JSON, TrainJob
    refusals, Pod Security refusals)."""
    with twin.start() as ex:
        ex.wait_until(lambda r: r.task("hold").attempts and r.task("hold").attempts[0].phase == "Running")
        keeper = KeeperThread(
            ex, ex.record.run_id, trainjobs=kind == "trainjob", settings=settings or PodSettings(), note=note
        ).start()
        if during is not None:
            during(ex, keeper)
        outcome = keeper.wait(TRAINJOB_S if kind == "trainjob" else WORKER_S)
        with ex.lock:
            pods = list({p["metadata"]["name"]: p for p in [*ex.workers.ended.values(), *ex.workers.list()]}.values())  # fmt: skip
            jobs = [m for j in ex.trainjobs.jobs.values() for m in j.refused]
            refused = list(ex.workers.refused)
        ex.terminate()
        ex.wait()
    return outcome, keeper, pods, jobs, refused


def _stuck(pods) -> list[str]:
    """Pods whose main container ended while the pod stays Running (an istio-proxy that never exits)."""
    out = []
    for p in pods:
        statuses = {c["name"]: c["state"] for c in p["status"].get("containerStatuses") or []}
        if p["status"]["phase"] == "Running" and "terminated" in statuses.get("main", {}):
            out.append(f"{p['metadata']['name']}: {sorted(statuses)}")
    return out


def test_istio_proxy_keeps_a_finished_pod_running_unless_it_opts_out_or_is_native():
    """The twin's injector (admission.py, Istio pkg/kube/inject injectRequired): a labelled namespace gets a
    proxy into a pod without the opt-out, as a regular container or as a native sidecar; not into one with
    `sidecar.istio.io/inject: "false"` (label or annotation, KFP 2.17's annotation on its own pods)."""
    from tests.twin.admission import inject

    bare = {"metadata": {"name": "p"}, "spec": {"containers": [{"name": "main"}]}}
    regular = inject(ISTIO, bare, native=False)["spec"]
    assert [c["name"] for c in regular["containers"]] == ["main", "istio-proxy"]
    native = inject(ISTIO, bare, native=True)["spec"]
    assert native["initContainers"][0]["restartPolicy"] == "Always"
    for where in ("labels", "annotations"):
        opted = {**bare, "metadata": {"name": "p", where: {"sidecar.istio.io/inject": "false"}}}
        assert inject(ISTIO, opted, native=False) == opted
    assert inject({}, bare, native=False) == bare


@pytest.mark.parametrize("kind", ["pod", "trainjob"])
def test_istio_injection_namespace_keeper_workers_finish(compile_pipeline, tmp_path, kind):
    """In a namespace labelled `istio-injection=enabled` the keeper's worker (or the TrainJob's node pods)
    ends and the keeper sees it end. Without the opt-out (components/podsettings.py ISTIO_OPT_OUT) the
    injected istio-proxy never exits: the worker stays Running after its main container ended and the keeper
    watches until its bound."""
    twin = _twin(compile_pipeline, tmp_path, namespace_labels=ISTIO)
    outcome, keeper, pods, _, _ = _keep(twin, kind)
    assert outcome == "succeeded", (outcome, keeper.logs[-5:], _stuck(pods))
    assert pods and all(c["name"] != "istio-proxy" for p in pods for c in p["spec"]["containers"])
    assert all(p["metadata"]["annotations"]["sidecar.istio.io/inject"] == "false" for p in pods)


@pytest.mark.parametrize("kind", ["pod", "trainjob"])
def test_pod_security_restricted_namespace_admits_the_keepers_workers(compile_pipeline, tmp_path, kind):
    """A namespace enforcing `restricted` (and labelled for Istio: the proxy is checked too) admits the
    worker pod and the TrainJob's node pods, which run to the end. Without the securityContext
    (podsettings.pod_security_context / container_security_context) the worker pod is refused 403 (the
    keeper fails) and the node pods are refused to the Job controller (the TrainJob never starts)."""
    twin = _twin(compile_pipeline, tmp_path, namespace_labels={**ISTIO, **RESTRICTED})
    outcome, keeper, pods, jobs, refused = _keep(twin, kind)
    assert refused == [] and jobs == [], (refused[:1], jobs[:1])
    assert outcome == "succeeded", (outcome, keeper.logs[-5:])
    assert len(pods) == (2 if kind == "trainjob" else 1)


def test_pod_security_refuses_a_pod_without_the_security_context_with_the_api_servers_message():
    """k8s.io/pod-security-admission: the message of a refused pod names each failed check and its fix."""
    pod = worker_manifest(Slot("learner", "r", 0), 0, WorkerSpec(image="img", command=["true"]), KEEPER_POD)
    assert pod_security(RESTRICTED, pod) == ""
    del pod["spec"]["securityContext"], pod["spec"]["containers"][0]["securityContext"]
    name = pod["metadata"]["name"]
    assert pod_security({"pod-security.kubernetes.io/enforce": "baseline"}, pod) == ""
    assert pod_security(RESTRICTED, pod) == (
        f'pods "{name}" is forbidden: violates PodSecurity "restricted:latest": allowPrivilegeEscalation != '
        'false (container "main" must set securityContext.allowPrivilegeEscalation=false), unrestricted '
        'capabilities (container "main" must set securityContext.capabilities.drop=["ALL"]), runAsNonRoot != '
        'true (pod or container "main" must set securityContext.runAsNonRoot=true), seccompProfile (pod or '
        'container "main" must set securityContext.seccompProfile.type to "RuntimeDefault" or "Localhost")'
    )


@pytest.mark.parametrize("kind", ["pod", "trainjob"])
def test_kueue_queue_without_quota_waits_then_runs_when_quota_comes(compile_pipeline, tmp_path, kind):
    """A run whose Kueue queue has no quota waits: the worker pod stays gated (the TrainJob suspended), the
    keeper logs that it waits, notes it in the run's store (what `ddiloco summary` shows under `waiting`) and
    does not fail; once the queue gets quota the workload is admitted and finishes, and the note is emptied.
    Without the queue label (`kueue_queue` not passed through, podsettings.QUEUE_LABEL) Kueue never sees the
    workload: it runs outside the queue's quota at once."""
    queues = {"gpu-queue": {}}  # the queue exists; its ClusterQueue has no quota yet

    def during(ex, keeper):
        end = time.monotonic() + 60
        while not any("waits" in line for line in keeper.logs) and time.monotonic() < end:
            time.sleep(0.2)
        time.sleep(3)  # never admitted while the queue has no quota
        with ex.lock:
            started = [w.name for w in ex.workers.pods.values() if w.proc is not None]
        assert keeper.outcome is None and started == [], (keeper.outcome, started, keeper.logs[-3:])
        said.update(keeper_waits(store))
        with ex.lock:
            ex.cluster.queues["gpu-queue"] = {"cpu": "1"}  # the platform team gives the queue quota

    store, said = open_store(f"memory://kueue-note-{kind}"), {}
    note = WaitNote(lambda: store, "learner-0")
    twin = _twin(compile_pipeline, tmp_path, queues=queues)
    outcome, keeper, pods, _, _ = _keep(twin, kind, PodSettings(queue="gpu-queue"), during, note)
    assert outcome == "succeeded", (outcome, keeper.logs[-5:])
    waits = [line for line in keeper.logs if "waits" in line]
    assert waits and "waiting for Kueue to admit it (queue 'gpu-queue')" in waits[0], keeper.logs
    assert "waiting for Kueue to admit it (queue 'gpu-queue')" in said["learner-0"]["waiting"], said
    assert keeper_waits(store) == {}  # admitted and finished: the note no longer says it waits


@pytest.mark.parametrize("native", [False, True], ids=["regular", "native"])
def test_istio_twin_proxy_outlives_main_only_as_a_regular_container(compile_pipeline, tmp_path, native):
    """The twin's kubelet with an injected proxy (admission.py): a regular istio-proxy keeps a restartPolicy
    Never pod Running after its main container ended (kubelet_pods.go getPhase: a container still runs); a
    native sidecar (init container, restartPolicy Always) is stopped and the pod Succeeds."""
    from kubernetes import client

    twin = _twin(compile_pipeline, tmp_path, namespace_labels=ISTIO, istio_native_sidecars=native)
    with twin.start() as ex:
        ex.wait_until(lambda r: r.task("hold").attempts and r.task("hold").attempts[0].phase == "Running")
        conf = client.Configuration()
        conf.host = ex.api.url
        api = client.CoreV1Api(client.ApiClient(conf))
        body = {"metadata": {"name": "bare"}, "spec": {"restartPolicy": "Never", "containers": [
            {"name": "main", "image": "img", "command": ["python3", "-c", "print('done')"]}]}}  # fmt: skip
        api.create_namespaced_pod(NAMESPACE, body)

        def main_ended(r):
            w = ex.workers.pods.get("bare")
            return w is not None and w.terminated is not None

        ex.wait_until(main_ended, 30)
        time.sleep(1)  # a few ticks: the phase does not move on
        pod = api.read_namespaced_pod("bare", NAMESPACE)
        ex.terminate()
        ex.wait()
    names = [c.name for c in pod.spec.containers] + [c.name for c in pod.spec.init_containers or []]
    assert "istio-proxy" in names
    assert pod.status.phase == ("Succeeded" if native else "Running")
