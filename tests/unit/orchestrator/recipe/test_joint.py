"""The joint mode of the recipe on its own (no services): what it accepts, what it refuses
and names, and the per-agent wheres checked against a namespace's tags."""

from __future__ import annotations

import pytest

from claw_tasks.format.schema import FieldSpec, Schema
from orchestrator import Recipe
from orchestrator.recipe.base import RecipeError

AGENTS = {"agents": ["a", "b"]}


def recipe(**kw) -> dict:
    base = {
        "name": "j",
        "batch_size": 8,
        "fields": ["obs", "state", "next_state", "team_reward", "step_ids"],
        "sources": [{"name": "s"}],
        "joint": AGENTS,
    }
    return {**base, **kw}


def test_a_joint_recipe_validates_against_a_multi_agent_schema():
    r = Recipe.model_validate(
        recipe(
            sources=[{"name": "s", "any_agent": "reward > 0", "all_agents": {"terminated": False}}]
        )
    )
    schema = Schema(
        fields={"obs": FieldSpec("<f4", (4,)), "state": FieldSpec("<f4", (None, 6))},
        tags={"joint_episode": "num", "joint_agents": "num"},
    )
    r.validate_against(schema)
    assert r.joint is not None and r.joint.agents == ["a", "b"]
    assert Recipe.model_validate(r.model_dump()) == r


@pytest.mark.parametrize(
    ("change", "says"),
    [
        (
            {"sources": [{"name": "s", "any_agent": "reward > 0"}], "joint": None},
            "only in a joint recipe",
        ),
        ({"joint": {"agents": ["a", "a"]}}, "duplicate agents"),
        ({"joint": {"agents": []}}, "agents"),
        ({"n_step": 3}, "single joint steps"),
        ({"sequence_length": 4}, "single joint steps"),
        (
            {"sources": [{"name": "s", "sampler": {"kind": "group", "group_size": 2}}]},
            "draws groups",
        ),
        ({"sources": [{"name": "s", "all_agents": "age < 1h"}]}, "window"),
        ({"sources": [{"name": "s", "any_agent": "reward >"}]}, "any_agent"),
    ],
)
def test_what_a_joint_recipe_refuses(change, says):
    with pytest.raises(ValueError, match=says):
        Recipe.model_validate(recipe(**change))


def test_per_agent_wheres_are_checked_against_the_tags():
    r = Recipe.model_validate(recipe(sources=[{"name": "s", "any_agent": "tags.nope > 1"}]))
    with pytest.raises(RecipeError, match=r"sources\[0\] \(s\)\.any_agent"):
        r.validate_against(Schema(fields={"obs": FieldSpec("<f4", (4,))}))
    with pytest.raises(RecipeError, match="'state' needs the global state"):
        Recipe.model_validate(recipe()).validate_against(
            Schema(fields={"obs": FieldSpec("<f4", (4,))})
        )
    plain = Recipe.model_validate({**recipe(), "joint": None, "fields": ["obs"]})
    with pytest.raises(RecipeError, match="'state' is not a field"):
        plain.model_copy(update={"fields": ["state"]}).validate_against(
            Schema(fields={"obs": FieldSpec("<f4", (4,))})
        )
