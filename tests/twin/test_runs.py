"""Small compiled pipelines run through the twin: real processes, the rules end to end."""

# No `from __future__ import annotations`: kfp reads the components' annotations at definition time.
import json

import pytest
from kfp import dsl, kubernetes
from kfp.dsl import PipelineTaskFinalStatus

from tests.twin import KFP_2_17, Cluster, Twin, pod_hostname, stragglers
from tests.twin.argo import pod_name

pytestmark = pytest.mark.twin
ALWAYS = {"spec": {"templateDefaults": {"retryStrategy": {"limit": "0", "retryPolicy": "Always"}}}}


def _c(func):
    return dsl.component(func, base_image="python:3.11", install_kfp_package=False)


@_c
def echo(a: str, n: int = 3, tag: str = "x") -> str:
    import json
    import os
    import socket

    keys = (
        "HOSTNAME",
        "KFP_POD_NAME",
        "WF",
        "NS",
        "AK",
        "RUN_KEY",
        "KFP_RETRY_INDEX",
        "KUBERNETES_SERVICE_HOST",
    )
    seen = {
        "a": a,
        "n": n,
        "tag": tag,
        "gethostname": socket.gethostname(),
        **{k: os.environ.get(k) for k in keys},
    }
    print("SEEN " + json.dumps(seen))
    return a + "!"


@_c
def flaky(fail_below: int = 99, code: int = 3, sleep_s: float = 0.0, then_sleep_s: float = 0.0):
    """Attempts below `fail_below` sleep sleep_s, exit `code`; later ones sleep then_sleep_s, succeed."""
    import os
    import sys
    import time

    if int(os.environ.get("KFP_RETRY_INDEX", "0")) < fail_below:
        time.sleep(sleep_s)
        sys.exit(code)
    time.sleep(then_sleep_s)


@_c
def final(status: PipelineTaskFinalStatus):
    print("FINAL", status.state, status.pipeline_task_name)


def _twin(path, tmp_path, **kw) -> Twin:
    return Twin(
        path, tmp_path / "twin", **{"time_scale": 10, "timeout_s": 60, "pending_timeout_s": 0.5, **kw}
    )


def _seen(attempt) -> dict:
    line = next(x for x in attempt.log.read_text().splitlines() if x.startswith("SEEN "))
    return json.loads(line[5:])


def test_inputs_outputs_names_env_and_hostnames(compile_pipeline, tmp_path):
    @dsl.pipeline(name="two-steps")
    def two(word: str = "hi", bucket: str = "mlp"):
        a = echo(
            a=f"s3://{bucket}/{word}/{dsl.PIPELINE_JOB_ID_PLACEHOLDER}", tag=dsl.PIPELINE_JOB_ID_PLACEHOLDER
        )
        a.set_retry(num_retries=1, backoff_duration="1s", backoff_factor=2, backoff_max_duration="60s")
        kubernetes.add_pod_label(a, "ddiloco.io/role", "learner")
        kubernetes.use_secret_as_env(a, secret_name="s3", secret_key_to_env={"accesskey": "AK"})
        kubernetes.use_secret_as_env(
            a, secret_name="run-key", secret_key_to_env={"key": "RUN_KEY"}, optional=True
        )
        kubernetes.use_field_path_as_env(a, "WF", "metadata.labels['workflows.argoproj.io/workflow']")
        kubernetes.use_field_path_as_env(a, "NS", "metadata.namespace")
        echo(a=a.output)

    wf = "two-steps-" + "w" * 20  # long enough for a 70+ character pod name
    cluster = Cluster(namespace="team-a", secrets={"s3": {"accesskey": "AK1"}})
    run = _twin(
        compile_pipeline(two), tmp_path, cluster=cluster, workflow_name=wf, workflow_defaults=KFP_2_17
    ).run()
    assert run.phase == "Succeeded", run.explain()
    first, second = run.task("echo").attempts[0], run.task("echo-2").attempts[0]
    seen = _seen(first)
    assert seen["a"] == "s3://mlp/hi/{{$.pipeline_job_uuid}}"  # channels resolved, the embedded uuid not
    assert seen["tag"] == run.run_id and seen["n"] == 3  # whole-value uuid; the default
    assert _seen(second)["a"] == "s3://mlp/hi/{{$.pipeline_job_uuid}}!"  # a task output
    assert first.node_name == f"{wf}(0).root(0).echo(0).executor(0)"
    assert first.pod_name == pod_name(wf, first.node_name, "metadata-0-1-retry-system-container-impl")
    # no KFP retry, but the stock templateDefaults give every template a retryStrategy: "(0)"
    assert second.pod_name == pod_name(wf, f"{wf}(0).root(0).echo-2(0).executor(0)", "system-container-impl")
    assert len(first.pod_name) > 63
    assert seen["HOSTNAME"] == seen["gethostname"] == pod_hostname(first.pod_name) == first.pod_name[:63]
    assert seen["KFP_POD_NAME"] == first.pod_name and seen["KFP_RETRY_INDEX"] == "0"
    assert (seen["WF"], seen["NS"], seen["AK"], seen["RUN_KEY"]) == (wf, "team-a", "AK1", None)
    assert seen["KUBERNETES_SERVICE_HOST"] is None
    assert first.labels["ddiloco.io/role"] == "learner"
    assert first.labels["workflows.argoproj.io/workflow"] == wf
    assert _seen(second)["KFP_RETRY_INDEX"] is None  # only KFP's retry templates carry it
    assert stragglers(run.run_id) == []


@dsl.pipeline(name="retries")
def _retries():
    a = flaky()
    a.set_retry(num_retries=2, backoff_duration="1s", backoff_factor=2.0, backoff_max_duration="300s")
    b = flaky()
    b.set_retry(num_retries=2, backoff_duration="1s", backoff_factor=1.5, backoff_max_duration="300s")
    c = flaky(fail_below=1, sleep_s=30.0)  # deleted by the test while it sleeps
    c.set_retry(num_retries=2, backoff_duration="1s", backoff_factor=2.0, backoff_max_duration="300s")


@pytest.mark.parametrize("defaults", ["argo", "kfp-2.17"])
def test_retry_policy_limit_and_factor(compile_pipeline, tmp_path, defaults):
    wd = KFP_2_17 if defaults == "kfp-2.17" else None
    with _twin(compile_pipeline(_retries), tmp_path, workflow_defaults=wd).start() as ex:
        ex.wait_until(lambda r: [a.phase for a in r.task("flaky-3").attempts] == ["Running"])
        ex.delete_pod("kubeflow", ex.record.task("flaky-3").attempts[0].pod_name, 0)
        run = ex.wait()
    assert run.phase == "Failed"
    plain, fractional, deleted = run.task("flaky"), run.task("flaky-2"), run.task("flaky-3")
    if wd is None:  # Argo's default OnFailure: retried up to the limit, each attempt a new pod
        assert [a.phase for a in plain.attempts] == ["Failed"] * 3 and plain.message == "No more retries left"
        assert len({a.pod_name for a in plain.attempts}) == 3
        suffixes = [a.node_name.rsplit(".", 1)[1] for a in plain.attempts]
        assert suffixes == ["executor(0)", "executor(1)", "executor(2)"]
        attempts = plain.attempts
        waits = [b.created_cluster - a.finished_cluster for a, b in zip(attempts, attempts[1:], strict=False)]
        assert waits[0] >= 1 and waits[1] >= 2, waits  # 1s, then 1s * 2^1
        assert [a.phase for a in deleted.attempts] == ["Error"]  # a deleted pod is not
        assert "OnFailure does not retry a Error" in deleted.reason
    else:  # KFP 2.17's templateDefaults add retryPolicy OnError: a failed main container is not retried
        assert len(plain.attempts) == 1 and "retryPolicy OnError does not retry a Failed pod" in plain.reason
        assert plain.attempts[0].exit_code == 3 and plain.message == "main: Error (exit code 1)"
        assert [a.phase for a in deleted.attempts] == ["Error", "Succeeded"]  # but a deleted pod is
    # "1.5" fails intstr.Int32 at the first retry decision: the impl's retry node errors
    why = "value '1.5' cannot be resolved to an int"
    if wd is None:
        assert len(fractional.attempts) == 1 and (fractional.phase, fractional.message) == ("Error", why)
    else:  # ... and so does its executor DAG, which the stock retryStrategy (OnError, limit 2) runs twice more
        names = [a.node_name.split(".")[-2:] for a in fractional.attempts]
        assert names == [[f"flaky-2({k})", "executor(0)"] for k in range(3)], names
        assert fractional.phase == "Error" and fractional.message == "No more retries left"
        assert why in fractional.reason, fractional.reason


def test_max_duration_and_execution_deadline(compile_pipeline, tmp_path):
    @dsl.pipeline(name="max-duration")
    def md():
        for task in (
            flaky(fail_below=1, sleep_s=30.0),
            flaky(fail_below=1, sleep_s=30.0),
            flaky(fail_below=1, then_sleep_s=60.0),
        ):  # early, late, overrun
            task.set_retry(num_retries=5, backoff_duration="0s", backoff_max_duration="40s")

    with _twin(compile_pipeline(md), tmp_path, time_scale=8, workflow_defaults=ALWAYS).start() as ex:
        ex.wait_until(
            lambda r: all(t.attempts and t.attempts[0].phase == "Running" for t in r.tasks.values())
        )
        early = ex.record.task("flaky").attempts[0].pod_name
        assert ex.now_cluster() < 40 and ex.delete_pod("kubeflow", early, 0) is not None  # within maxDuration
        ex.wait_until(lambda r: ex.now_cluster() > 45)
        assert ex.delete_pod("kubeflow", ex.record.task("flaky-2").attempts[0].pod_name, 0) is not None
        run = ex.wait()
    e, late, over = run.task("flaky"), run.task("flaky-2"), run.task("flaky-3")
    assert [a.phase for a in e.attempts] == ["Error", "Succeeded"] and e.phase == "Succeeded"
    assert e.attempts[0].message == "pod deleted"
    assert e.attempts[1].execution_deadline_cluster == pytest.approx(e.attempts[0].created_cluster + 40)
    assert (late.phase, late.message, len(late.attempts)) == ("Error", "Max duration limit exceeded", 1)
    assert [a.phase for a in over.attempts] == ["Failed", "Failed"]
    assert over.message == "Max duration limit exceeded"
    assert over.attempts[1].message == "Step exceeded its deadline"  # the retried pod is cut at the deadline
    assert over.attempts[1].finished_cluster >= over.attempts[0].created_cluster + 40
    # the root DAG takes the phase of its first failing target in name order (assessDAGPhase): flaky-2's
    assert run.phase == "Error" and stragglers(run.run_id) == []


def test_active_deadline_and_unschedulable_and_missing_secret(compile_pipeline, tmp_path):
    @dsl.pipeline(name="pods")
    def pods():
        slow = flaky(fail_below=0, then_sleep_s=60.0)
        kubernetes.set_timeout(slow, 20)
        gpu = flaky(fail_below=0).set_accelerator_type("nvidia.com/gpu").set_accelerator_limit(1)
        kubernetes.add_node_selector_json(gpu, {"nvidia.com/gpu.present": "true"})
        kubernetes.add_toleration_json(
            gpu, [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
        )
        fits = flaky(fail_below=0).set_accelerator_type("nvidia.com/gpu").set_accelerator_limit(1)
        kubernetes.add_node_selector_json(fits, {})
        kubernetes.add_toleration_json(
            fits, [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
        )
        nosecret = flaky(fail_below=0)
        kubernetes.use_secret_as_env(nosecret, secret_name="absent", secret_key_to_env={"k": "K"})

    run = _twin(compile_pipeline(pods), tmp_path, time_scale=20).run()
    slow, gpu, fits, nosecret = (run.task(n) for n in ("flaky", "flaky-2", "flaky-3", "flaky-4"))
    assert slow.attempts[0].message == "Pod was active on the node longer than the specified deadline"
    assert gpu.phase == "Failed" and "Unschedulable" in gpu.reason and "node affinity/selector" in gpu.reason
    assert gpu.attempts[0].phase == "Pending"
    assert fits.phase == "Succeeded" and fits.attempts[0].node.startswith("gke-twin-gpu-pool")
    assert (
        nosecret.phase == "Failed"
        and 'CreateContainerConfigError: secret "absent" not found' in nosecret.reason
    )


def test_exit_handler_runs_after_a_failed_step(compile_pipeline, tmp_path):
    @dsl.pipeline(name="exit")
    def ex_pipe():
        fin = final()
        with dsl.ExitHandler(fin):
            bad = flaky(fail_below=99)
            flaky(fail_below=0).after(bad)

    run = _twin(compile_pipeline(ex_pipe), tmp_path).run()
    assert run.phase == "Failed", run.explain()
    assert run.task("flaky").phase == "Failed" and run.task("flaky-2").phase == "Omitted"
    fin = run.task("final")
    assert fin.phase == "Succeeded" and fin.inputs["status"]["state"] == "FAILED"
    assert fin.attempts[0].labels["workflows.argoproj.io/on-exit"] == "true"
    assert fin.attempts[0].node_name == f"{run.workflow}.root.exit-handler-1.onExit.final.executor"
    assert "FINAL FAILED exit-handler-1" in fin.attempts[0].log.read_text()


def test_parallel_for_respects_its_parallelism(compile_pipeline, tmp_path):
    @dsl.pipeline(name="loop")
    def loop():
        with dsl.ParallelFor([0, 1, 2], parallelism=1) as i:
            flaky(fail_below=i, code=0, then_sleep_s=0.3)

    run = _twin(compile_pipeline(loop), tmp_path).run()
    assert run.phase == "Succeeded", run.explain()
    its = run.find("flaky")
    assert [t.key for t in its] == [f"for-loop-2/{i}/flaky" for i in range(3)]
    assert [t.inputs["fail_below"] for t in its] == [0.0, 1.0, 2.0]
    spans = sorted((t.attempts[0].started_real, t.attempts[0].finished_real) for t in its)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False)), spans  # never two at once
    assert (
        ".for-loop-2.iteration-iterations(1:1).iteration-item.flaky.executor" in its[1].attempts[0].node_name
    )


def test_items_of_an_untyped_list_parameter_arrive_as_strings(compile_pipeline, tmp_path):
    """The SDK types the loop item of a bare `list` parameter STRING; the iteration driver converts each item
    to text, and the task's driver then refuses it for an int input (resolve.go type validation)."""

    @dsl.pipeline(name="untyped")
    def untyped(items: list = [0, 1]):  # noqa: B006
        with dsl.ParallelFor(items) as i:
            flaky(fail_below=i)

    run = _twin(compile_pipeline(untyped), tmp_path).run()
    assert run.phase == "Failed" and not run.attempts()
    assert "type mismatch: expect NUMBER_INTEGER, got string" in run.find("flaky")[0].reason


def test_terminate_stops_pods_runs_the_exit_handler_and_leaves_nothing(compile_pipeline, tmp_path):
    @dsl.pipeline(name="term")
    def term():
        fin = final()
        with dsl.ExitHandler(fin):
            long = flaky(fail_below=0, then_sleep_s=60.0)
            long.set_retry(num_retries=3)
            flaky(fail_below=0).after(long)

    with _twin(compile_pipeline(term), tmp_path, workflow_defaults=ALWAYS).start() as ex:
        ex.wait_until(lambda r: r.task("flaky").attempts and r.task("flaky").attempts[0].phase == "Running")
        ex.terminate()
        run = ex.wait()
    assert run.terminated and run.phase == "Failed"
    long = run.task("flaky")
    assert [a.message for a in long.attempts] == ["Step exceeded its deadline"]  # and no retry
    assert run.task("flaky-2").phase == "Omitted" and run.task("final").phase == "Succeeded"
    assert stragglers(run.run_id) == []


def test_the_run_level_timeout_kills_everything(compile_pipeline, tmp_path):
    @dsl.pipeline(name="forever")
    def forever():
        flaky(fail_below=0, then_sleep_s=600.0)

    run = _twin(compile_pipeline(forever), tmp_path, timeout_s=1.5).run()
    assert run.timed_out and run.phase == "Failed" and "twin timeout" in run.message
    assert stragglers(run.run_id) == []


def test_a_pipeline_config_deadline_acts_like_terminate(compile_pipeline, tmp_path):
    @dsl.pipeline(name="deadline", pipeline_config=dsl.PipelineConfig(active_deadline_seconds=20))
    def deadline():
        flaky(fail_below=0, then_sleep_s=600.0)

    run = _twin(compile_pipeline(deadline), tmp_path, time_scale=20).run()
    assert run.phase == "Failed" and "activeDeadlineSeconds passed" in run.message
    assert run.task("flaky").attempts[0].message == "Step exceeded its deadline" and not run.terminated
