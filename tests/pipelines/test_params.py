"""The run-time parameters' table (`ddiloco.components.params`, issue 53): a row is all it takes to give the
pipeline a parameter, with its type, default and description in the KFP UI, its value in the steps it names,
its config key in the prepare step's `--set` list, and its line in the docs."""

from __future__ import annotations

import inspect

import pytest
import yaml
from ddiloco.components import params
from ddiloco.components.params import Param
from ddiloco.components.runtime import prepare_settings
from ddiloco.pipelines import join
from ddiloco.pipelines.compile import compile_pipeline
from ddiloco.pipelines.params_doc import render
from ddiloco.pipelines.pretrain import ClusterOptions, pipeline_function


def _ir(path):
    return next(yaml.safe_load_all(path.read_text()))


def _task(ir, display_name):
    """(component definition, task) of the task shown as `display_name`, in whichever DAG it lives."""
    for comp in [ir["root"], *ir["components"].values()]:
        for task in comp.get("dag", {}).get("tasks", {}).values():
            if task["taskInfo"]["name"] == display_name:
                return ir["components"][task["componentRef"]["name"]], task
    raise KeyError(display_name)


def test_a_row_is_a_parameter_of_the_ui_an_argument_of_its_steps_and_a_line_of_the_docs(
    tmp_path, monkeypatch
):
    row = Param(
        "sft_args",
        list,
        ["--steps", "3"],
        "More arguments of `ddiloco sft`, as they are.",
        to=("sft.extra_args",),
    )
    monkeypatch.setattr(params, "PRETRAIN", (*params.PRETRAIN, row))
    ir = _ir(compile_pipeline("pretrain", tmp_path / "p.yaml"))
    root = ir["root"]["inputDefinitions"]["parameters"]["sft_args"]
    assert root["description"] == row.description and root["defaultValue"] == ["--steps", "3"]
    assert root["parameterType"] == "LIST"
    comp, task = _task(ir, "sft")
    assert "extra_args" in comp["inputDefinitions"]["parameters"]
    assert task["inputs"]["parameters"]["extra_args"] == {
        "componentInputParameter": "pipelinechannel--sft_args"
    }
    _, other = _task(ir, "evaluate-final")  # the other steps with extra_args do not get it
    assert "extra_args" not in other["inputs"]["parameters"]
    assert '| `sft_args` | More arguments of `ddiloco sft`, as they are. | `["--steps", "3"]` |' in render(
        "pretrain"
    )


def test_a_row_with_a_config_key_is_set_by_the_prepare_step_from_its_input_of_that_name(monkeypatch):
    """KFP runs a component's own source, so a new input of prepare is one line in its signature
    (components/roles.py); the body passes every input to `prepare_settings` by name, which reads the table."""
    row = Param(
        "warmup", int, 0, "Warm-up steps; 0 keeps the recipe's.", to=("prepare",), config="train.warmup"
    )
    monkeypatch.setattr(params, "PRETRAIN", (*params.PRETRAIN, row))
    given = {"overrides": ["train.warmup=1"], "learners": 2, "max_learners": 8}
    assert prepare_settings({**given, "warmup": 50})[-2:] == ["diloco.learners=2", "train.warmup=50"]
    # 0: the recipe's value (or the override's)
    assert prepare_settings({**given, "warmup": 0})[-1] == "diloco.learners=2"
    with pytest.raises(ValueError, match=r"step 'prepare' inputs \['warmup'\].*components/roles.py"):
        pipeline_function()


@pytest.mark.parametrize("name", ["pretrain", "join"])
def test_the_pipeline_signature_is_the_table(name):
    func, table = (
        (join.pipeline_function(), params.JOIN) if name == "join" else (pipeline_function(), params.PRETRAIN)
    )
    sig = inspect.signature(func.pipeline_func).parameters
    assert [(n, p.annotation, p.default) for n, p in sig.items()] == [
        (r.name, r.type, r.default) for r in table
    ]
    assert {n: spec.description for n, spec in func.component_spec.inputs.items()} == {
        r.name: r.description for r in table
    }


def test_a_default_for_a_parameter_the_table_does_not_have_is_refused():
    with pytest.raises(
        ValueError, match=r"defaults for \['quroum'\]: ddiloco-pretrain has no such run parameter"
    ):
        pipeline_function(ClusterOptions(defaults={"quroum": 2}))
