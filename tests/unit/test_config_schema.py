"""The run config's JSON schema for editors (issue 52): generated from the dataclasses, committed under docs/."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest

from ddiloco.config.jsonschema import render, schema
from ddiloco.config.recipes import RECIPES, from_recipe

COMMITTED = Path(__file__).resolve().parents[2] / "docs" / "config.schema.json"
jsonschema = pytest.importorskip("jsonschema")


def test_the_committed_schema_is_the_generated_one():
    if os.environ.get("UPDATE_GOLDEN") == "1":
        COMMITTED.write_text(render())
    assert COMMITTED.read_text() == render(), (
        "docs/config.schema.json is stale: python -m ddiloco.config.jsonschema > docs/config.schema.json"
    )


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_every_recipe_is_a_valid_config_under_the_schema(recipe):
    doc = json.loads(json.dumps(dataclasses.asdict(from_recipe(recipe))))
    validator = jsonschema.Draft202012Validator(schema())
    assert not [e.message for e in validator.iter_errors({"recipe": recipe, **doc})]


def test_the_schema_refuses_what_the_config_refuses_and_describes_the_fields():
    s = schema()
    jsonschema.Draft202012Validator.check_schema(s)
    validator = jsonschema.Draft202012Validator(s)
    assert not validator.is_valid({"diloco": {"sync_evry": 8}})  # unknown key
    assert not validator.is_valid({"diloco": {"sync_every": "often"}})  # wrong type
    assert not validator.is_valid({"recipe": "nope"})
    assert validator.is_valid({"recipe": "tiny-cpu", "diloco": {"sync_every": 8}, "chaos": None})
    diloco = s["properties"]["diloco"]["properties"]
    assert diloco["sync_every"]["description"] and diloco["sync_every"]["type"] == "integer"
