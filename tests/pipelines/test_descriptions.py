"""The KFP UI explains every parameter (issue 52): descriptions in the compiled YAMLs, from one table with the docs.

Where KFP 2.17 puts them: `kfp.dsl.component_factory.extract_component_interface` parses the component's or
pipeline function's docstring with `docstring_parser` (`Args:` -> InputSpec.description, `Returns:` ->
OutputSpec.description), and `kfp.compiler.pipeline_spec_builder._build_component_spec_from_component_spec_structure`
copies them into `inputDefinitions` / `outputDefinitions`, for the pipeline's root too (`create_pipeline_spec`).
`ddiloco.components.descriptions.described` writes the components' docstrings from `DESCRIPTIONS`,
`ddiloco.components.params.pipeline_func` the pipelines' from the parameters' table.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml
from ddiloco.components.descriptions import DESCRIPTIONS, describe, docstring
from ddiloco.components.params import JOIN, PRETRAIN, description
from ddiloco.pipelines.compile import PIPELINES, compile_pipeline, golden_path
from ddiloco.pipelines.params_doc import TABLES, current, render, rendered

DOCS = Path(__file__).resolve().parents[2] / "docs" / "cluster.md"


def undescribed(path: Path) -> tuple[int, list[str]]:
    """(how many root parameters and component inputs/outputs `path` has, those without a description)."""
    ir = next(yaml.safe_load_all(path.read_text()))
    seen, missing = 0, []
    for name, param in ir["root"]["inputDefinitions"]["parameters"].items():
        seen += 1
        if not str(param.get("description", "")).strip():
            missing.append(f"root.{name}")
    for comp_name, comp in ir["components"].items():
        if "executorLabel" not in comp:  # a DAG of the compiler's (loop, exit handler): no UI inputs
            continue
        for side in ("inputDefinitions", "outputDefinitions"):
            for kind in ("parameters", "artifacts"):
                for name, spec in comp.get(side, {}).get(kind, {}).items():
                    seen += 1
                    if not str(spec.get("description", "")).strip():
                        missing.append(f"{comp_name}.{side}.{name}")
    return seen, missing


@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_every_root_parameter_and_component_input_output_of_the_golden_yamls_is_described(name):
    seen, missing = undescribed(golden_path(name))
    assert seen > 20
    assert not missing, f"{name}.yaml: no description for {missing}"


def test_the_pipeline_compiled_without_keepers_is_described_too(tmp_path):
    """--no-keeper compiles the role components themselves (max_steps, local_ranks, ...), not the keepers."""
    seen, missing = undescribed(compile_pipeline("pretrain", tmp_path / "p.yaml", keeper=False))
    assert seen > 20 and not missing, missing


def test_the_root_parameters_carry_the_tables_text():
    ir = next(yaml.safe_load_all(golden_path("pretrain").read_text()))
    params = ir["root"]["inputDefinitions"]["parameters"]
    assert {name: p["description"] for name, p in params.items()} == {p.name: p.description for p in PRETRAIN}
    join = next(yaml.safe_load_all(golden_path("join").read_text()))["root"]["inputDefinitions"]["parameters"]
    assert (
        join["learners"]["description"] == description(JOIN, "learners") != description(PRETRAIN, "learners")
    )


def test_a_name_without_a_description_fails_the_build_naming_it():
    def step(store: str, mystery: int = 0) -> str:
        """A step."""
        return store

    with pytest.raises(ValueError, match="step's 'mystery'"):
        docstring(step)
    assert describe("join_check", "store") == DESCRIPTIONS["join_check.store"]  # the qualified key wins


@pytest.mark.parametrize("table", TABLES)
def test_the_docs_parameter_tables_are_the_rendered_descriptions(table):
    text = DOCS.read_text()
    if os.environ.get("UPDATE_GOLDEN") == "1":
        DOCS.write_text(text := rendered(text))
    assert current(text, table) == render(table), (
        f"docs/cluster.md's {table} parameter table is stale: UPDATE_GOLDEN=1 pytest {__file__}"
    )
