"""Run-time parameters checked at compile / submit / schedule time (issue 52), with the prepare step's code."""

from __future__ import annotations

import pytest
import yaml
from ddiloco.components.runtime import check_run
from ddiloco.pipelines.compile import golden_path
from ddiloco.pipelines.validate import check_package, check_types, kind_of

from ddiloco.errors import ConfigError


def _ir(name: str) -> dict:
    return next(yaml.safe_load_all(golden_path(name).read_text()))


def test_a_misspelt_override_gets_the_did_you_mean_of_the_prepare_step():
    with pytest.raises(ConfigError, match="did you mean 'diloco.sync_every'"):
        check_package(_ir("smoke"), {"overrides": ["diloco.sync_evry=8"]})
    check_package(_ir("smoke"), {"overrides": ["diloco.sync_every=8"], "learners": 3})


def test_the_packages_compiled_limits_and_the_recipes_are_checked():
    with pytest.raises(ValueError, match="compiled for 1..4 concurrent learners"):  # smoke: max_learners 4
        check_package(_ir("smoke"), {"learners": 5})
    check_package(_ir("pretrain"), {"learners": 5})  # pretrain: 8
    with pytest.raises(ConfigError, match="unknown recipe 'nope'"):
        check_package(_ir("pretrain"), {"recipe": "nope"})
    with pytest.raises(ConfigError, match="chaos"):
        check_run({"recipe": "tiny-cpu", "chaos": "{events: 3}"}, max_learners=8)


def test_each_value_must_fit_its_parameter():
    with pytest.raises(ConfigError, match="learners='many' must be an integer"):
        check_package(_ir("pretrain"), {"learners": "many"})
    with pytest.raises(ConfigError, match="must be an integer"):
        check_types({"learners": True}, {"learners": kind_of(4)})
    with pytest.raises(ConfigError, match="must be a list"):
        check_types({"overrides": "diloco.codec=int4"}, {"overrides": kind_of([])})
    check_types({"learners": 3, "lm_eval": True}, {"learners": kind_of(4), "lm_eval": kind_of(False)})


def test_a_pipeline_without_a_recipe_checks_types_only():
    check_package(_ir("join"), {"site": "eu", "learners": 2})
    check_package({"root": {}}, {})


def test_placement_parameters_are_checked_as_the_driver_and_the_keepers_read_them():
    """KFP's driver decodes selectors into map[string]string and tolerations into v1.Toleration (an unknown
    field dropped); the keepers read pod_settings (`PodSettings.of`): each mistake is refused up front."""
    ir = _ir("pretrain")
    with pytest.raises(ConfigError, match="did you mean 'effect'"):
        check_package(
            ir, {"gpu_tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "efect": "NoSchedule"}]}
        )
    with pytest.raises(ConfigError, match="operator is one of"):
        check_package(ir, {"gpu_tolerations": [{"key": "k", "operator": "Exist"}]})
    with pytest.raises(ConfigError, match="gpu_node_selector=.*label: value strings"):
        check_package(ir, {"gpu_node_selector": {"pool": 3}})
    with pytest.raises(ConfigError, match="pod_settings: unknown keys"):
        check_package(ir, {"pod_settings": {"priorty_class": "high"}})
    check_package(
        ir, {"gpu_tolerations": [{"key": "k", "operator": "Equal", "value": "v", "effect": "NoExecute"}]}
    )
    with pytest.raises(
        ConfigError, match="cpu_node_selector"
    ):  # the join pipeline has no recipe: still checked
        check_run({"cpu_node_selector": ["pool"]}, max_learners=8)
