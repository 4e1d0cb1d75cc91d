"""Example recipes stay valid: parse, validate against a matching schema, build augment."""

from __future__ import annotations

from pathlib import Path

import pytest

from claw_tasks.schema import FieldSpec, Schema
from orchestrator import Recipe
from orchestrator.transforms.augment import build_pipelines

EXAMPLES = sorted((Path(__file__).parents[1] / "examples" / "recipes").glob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_recipe_is_valid(path):
    recipe = Recipe.from_yaml(path)
    schema = Schema(fields={"obs": FieldSpec("|u1", (84, 84, 3)), "action": FieldSpec("<f4", (4,))})
    recipe.validate_against(schema)
    build_pipelines(recipe.augment)
    assert sum(recipe.counts) == recipe.batch_size
