"""The stock retry defaults on DAG templates and the exit hook, through small compiled pipelines (real
processes): rules in dagretry.py."""

# No `from __future__ import annotations`: kfp reads the components' annotations at definition time.
import pytest
from kfp import dsl
from kfp.dsl import PipelineTaskFinalStatus

from tests.twin import KFP_2_17, Twin, stragglers

pytestmark = pytest.mark.twin


def _c(func):
    return dsl.component(func, base_image="python:3.11", install_kfp_package=False)


@_c
def echo(a: str) -> str:
    return a + "!"


@_c
def final(status: PipelineTaskFinalStatus):
    print("FINAL", status.state)


@dsl.pipeline(name="hook")
def _hooked():
    first = echo(a="x")
    fin = final()
    with dsl.ExitHandler(fin):
        echo(a=first.output)


def test_the_exit_hook_does_not_run_when_the_groups_dag_driver_fails(compile_pipeline, tmp_path):
    """KFP hooks the report on the group's DAG task, which depends on its driver: a failed driver leaves
    the group Omitted, and Argo runs hooks only for Completed nodes (exit_handler.go runOnExitNode)."""
    path = compile_pipeline(_hooked)
    text = path.read_text()
    broken = text.replace(
        "outputParameterKey: Output\n                producerTask: echo",
        "outputParameterKey: Nope\n                producerTask: echo",
    )
    assert broken != text
    path.write_text(broken)  # the group's driver cannot resolve its input
    run = Twin(path, tmp_path / "twin", workflow_defaults=KFP_2_17, time_scale=10, timeout_s=60).run()
    group, hook = run.task("exit-handler-1"), run.task("final")
    assert group.phase == "Omitted" and "driver failed" in group.reason, run.explain()
    assert hook.phase == "Omitted" and hook.attempts == [], run.explain()
    assert run.phase == "Failed" and run.task("echo").phase == "Succeeded"
    assert stragglers(run.run_id) == []
