"""The backend twin: runs a *compiled* KFP pipeline YAML the way Kubeflow Pipelines 2.17 on Argo Workflows
v4.0.5 would, with each component as a real local process.

What it is: an executor for KFP IR (the two-document YAML `ddiloco pipeline compile` writes) that follows
the rules of KFP 2.17.0's driver, launcher and Argo compiler, Argo v4.0.5's controller and the Kubernetes
behaviour they rely on - each rule written down next to the code that follows it, with the source file and
function it was read from (`git show 2.17.0:<path>` in the kubeflow/pipelines mirror, `git show
v4.0.5:<path>` in argoproj/argo-workflows). It is not KFP: no API server, no MLMD, no Argo Workflow object,
no driver or launcher binaries; the same inputs reach the same component command lines, and the same
failures, retries, names and deadlines happen, as far as those rules reach.

Layout (each module's docstring has its "Design choices" and "Rules and their sources"): gofmt (Go/protobuf
value formatting), ir (loading, what is refused), resolve (the driver's input resolution), launcher (executor
input, command line, outputs), platform (KFP's pod spec patch), cluster (Kubernetes: nodes, secrets, env,
names), admission (Istio's sidecar injector and Pod Security admission for created pods), kueue (Kueue's
quota admission of created pods and TrainJobs), argo (retry strategies and decisions, names), dag (DAGs,
loops, exit handlers), dagretry (the
retry nodes above DAG templates, DAG phases), attempts (a container task's pods), failures (how the cluster
ends a pod: preemption, eviction, OOM kill, admission, drain), pods (processes), kubeapi (the API
stand-in), workers (pods a step creates through it: the keepers' workers), apiview (what the API stand-in
serves of a run), engine (the controller: `Twin`),
records (results).

What it can show: inputs as the driver resolves them (whole-value `{{$.pipeline_job_uuid}}` only, channel
placeholders inside f-strings through the launcher's substring replacement, defaults, task outputs,
ParallelFor items, trigger policies), executor input JSON, Argo retry semantics (retryPolicy incl. the
cluster's templateDefaults, backoff, maxDuration, "would exceed max duration", execution deadlines; DAG
re-runs under templateDefaults, exit hooks skipped for an Omitted group), pod
names and their 63-character hostnames, pod labels and downward-API env, secrets as env, node selectors and
tolerations against a list of pretend nodes, activeDeadlineSeconds, exit handlers, ParallelFor parallelism,
KFP's terminate, chaos through a stand-in of the Kubernetes pod API, and pods a step creates through it
(scheduled, run, ended by the failure kinds, garbage-collected with their owners).

What it cannot show: scheduling beyond label/taint/capacity matching (no affinity, no preemption, no
image pulls), GPUs (a GPU pod is a CPU process), real networking (every pod is on 127.0.0.1, no Services,
no NetworkPolicies, no DNS names), MLMD and caching (caching is never applied), the real artifact store
(artifact URIs are local paths, see Deviations), KFP's driver pods, the API server's own checks, and
anything that needs the real hostname: a pod's `socket.gethostname()` returns its truncated hostname only
through a `sitecustomize` stand-in. ddiloco must identify pods by the downward-API pod name
(`fieldPathAsEnv` metadata.name), which the twin provides untruncated.

Deviations, on purpose: artifact URIs are absolute paths under the work dir instead of `minio://...`
(KFP's SDK uses a plain-path URI as its local path); the chaos pod reaches the API stand-in through
KUBECONFIG (real pods use their service account; KUBERNETES_SERVICE_HOST is never set so the in-cluster
config is skipped); time is scaled (`time_scale`) for every Argo/Kubernetes duration while processes run in
real time; a pod that would stay Pending forever fails its task after `pending_timeout_s`.

Typical use (the public API is `Twin`, `TwinExecution`, `TwinRun` and the cluster/defaults helpers below):

    from tests.twin import KFP_2_17, Cluster, Twin, stragglers

    twin = Twin("pipelines/pretrain.yaml", tmp_path / "twin",
                cluster=Cluster(namespace="kubeflow", secrets={"mlpipeline-minio-artifact": {...}}),
                workflow_defaults=KFP_2_17, time_scale=60, timeout_s=600, env={...})
    run = twin.run({"recipe": "tiny-cpu"})            # blocks; or:
    with twin.start({...}) as ex:                      # a TwinExecution
        ex.wait_until(lambda r: r.find("learner") and r.find("learner")[0].attempts)
        ex.delete_pod("kubeflow", pod, 0)              # or through the API stand-in at ex.api.url
        ex.inject(pod, "preempt")                      # or evict, oom, admission, drain (failures.KINDS)
        ex.terminate()                                 # KFP TerminateRun
        run = ex.wait()
    assert run.phase == "Succeeded", run.explain()    # explain(): failed attempts and their log tails
    assert stragglers(run.run_id) == []
"""

from tests.twin.cluster import Cluster, Node, default_nodes, pod_hostname
from tests.twin.engine import Twin, TwinExecution
from tests.twin.ir import PipelineIR, TwinUnsupported, load_ir
from tests.twin.pods import stragglers
from tests.twin.records import AttemptRecord, TaskRecord, TwinRun
from tests.twin.workflow_defaults import KFP_2_17, load_workflow_defaults

__all__ = [
    "KFP_2_17",
    "AttemptRecord",
    "Cluster",
    "Node",
    "PipelineIR",
    "TaskRecord",
    "Twin",
    "TwinExecution",
    "TwinRun",
    "TwinUnsupported",
    "default_nodes",
    "load_ir",
    "load_workflow_defaults",
    "pod_hostname",
    "stragglers",
]
