"""The recipe model: the reference recipe of docs/recipes.md, defaults, and errors that name
the offending key."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from pydantic import ValidationError

from orchestrator.recipe.base import RecipeError
from orchestrator.recipe.model import Recipe
from tests.support.llmturns import group_recipe
from tests.support.paths import ROOT

DOCS = ROOT / "docs" / "recipes.md"


def reference_yaml() -> str:
    """The annotated recipe of docs/recipes.md ("A complete recipe")."""
    text = DOCS.read_text()
    start = text.index("```yaml\n", text.index("## A complete recipe")) + len("```yaml\n")
    return text[start : text.index("```", start)]


@dataclass
class Schema:
    fields: dict = field(default_factory=lambda: {"obs": None, "action": None, "prompt_ids": None})
    tags: dict = field(default_factory=lambda: {"color": "str", "difficulty": "num"})


def minimal(**kw) -> dict:
    return {"name": "r", "batch_size": 8, "fields": ["obs"], "sources": [{"name": "a"}], **kw}


def error(data: dict) -> str:
    with pytest.raises(ValidationError) as e:
        Recipe.model_validate(data)
    return str(e.value)


def _nested_not(depth: int) -> dict:
    where: dict = {"terminated": True}
    for _ in range(depth):
        where = {"not": where}
    return where


def test_reference_recipe_of_the_docs(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(reference_yaml())
    r = Recipe.from_yaml(path)
    assert r.name == "grasp-hard" and r.batch_size == 256
    hard, early = r.sources
    assert hard.window.last_steps == 1_000_000 and hard.window.max_age_s is None
    assert (hard.sampler.kind, hard.sampler.alpha, hard.sampler.beta) == ("priority", 0.6, 0.4)
    assert early.where == {"reward": {"lt": 0}, "step_index": {"lt": "$early_cutoff"}}
    assert r.params == {"early_cutoff": 100}
    assert (r.n_step, r.gamma, r.sequence_length) == (3, 0.99, 1)
    assert r.augment["next_obs"] == "same"
    assert r.augment["obs"][1] == {"color_jitter": {"brightness": 0.2, "p": 0.8}}
    assert (r.prefetch.depth, r.prefetch.low_water) == (8, 4)
    assert r.rate_limit.min_size == 1000
    assert (r.seed, r.version) == (7, 1)
    assert r.counts == [205, 51]
    assert Recipe.model_validate(r.model_dump()) == r
    r.validate_against(Schema())
    example = Recipe.from_yaml(ROOT / "examples" / "recipes" / "grasp-hard.yaml")
    assert example == r.model_copy(update={"seed": None})  # the same, without the seed


def test_the_reference_documents_every_key_and_augment_op():
    """docs/recipes.md names every recipe key, every augment op and each op's params."""
    import inspect

    from orchestrator.recipe.options import (
        Admission,
        Layout,
        Nearest,
        Prefetch,
        RateLimit,
        Tokens,
    )
    from orchestrator.recipe.sources import SamplerSpec, Source, Transition, Window
    from orchestrator.transforms.augment import OPS

    text = DOCS.read_text()
    models = (
        *(Recipe, Source, Window, SamplerSpec, Prefetch, RateLimit, Tokens, Nearest, Admission),
        Layout,
    )
    for model in (*models, Transition):
        keys = [f.alias or k for k, f in model.model_fields.items()]
        missing = [k for k in keys if f"`{k}`" not in text]
        assert not missing, f"{model.__name__} keys not in docs/recipes.md: {missing}"
    rows = {line.split("`")[1]: line for line in text.splitlines() if line.startswith("| `")}
    for name, op in OPS.items():
        assert name in rows, f"augment op {name!r} has no row in docs/recipes.md"
        params = [p for p in inspect.signature(op).parameters if f"`{p}`" not in rows[name]]
        assert not params, f"augment op {name!r}: params {params} not in its row"


def test_defaults():
    r = Recipe.model_validate(minimal())
    src = r.sources[0]
    assert (src.weight, src.where, src.window, src.sampler.kind) == (1.0, {}, None, "uniform")
    assert (r.n_step, r.sequence_length, r.augment, r.rate_limit) == (1, 1, {}, None)
    assert r.counts == [8]


def test_yaml_must_be_a_mapping(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("- a\n- b\n")
    with pytest.raises(ValueError, match="a recipe is a YAML mapping"):
        Recipe.from_yaml(path)


@pytest.mark.parametrize(
    ("data", "where", "message"),
    [
        (minimal(colour=1), "colour", "Extra inputs are not permitted"),
        (
            minimal(sources=[{"name": "a", "wieght": 1}]),
            "sources.0.wieght",
            "Extra inputs are not permitted",
        ),
        (minimal(prefetch={"depth": 4, "lowwater": 1}), "prefetch.lowwater", "Extra inputs"),
        (minimal(batch_size=0), "batch_size", "greater than 0"),
        (minimal(fields=[]), "fields", "at least 1 item"),
        (minimal(fields=["obs", "obs"]), "fields", "duplicate fields: ['obs']"),
        (minimal(sources=[]), "sources", "at least 1 item"),
        (minimal(name="a b"), "name", "should match pattern"),
        (minimal(gamma=1.5), "gamma", "less than or equal to 1"),
        (
            minimal(sources=[{"name": "a", "where": {"task": "x"}}]),
            "sources.0.where",
            "task: unknown metadata key",
        ),
        (
            minimal(sources=[{"name": "a", "where": {"reward": {"between": [1, 2, 3]}}}]),
            "sources.0.where",
            r"reward: between takes [low, high]",
        ),
        (
            minimal(sources=[{"name": "a", "where": {"reward": {"gt": "$cut"}}}]),
            "",
            "sources[0] (a).where.reward: param $cut is not defined",
        ),
        (
            minimal(
                sources=[{"name": "a", "where": {"reward": {"gt": "$cut"}}}], params={"cut": "x"}
            ),
            "",
            "sources[0] (a).where.reward: gt: expected a number, got 'x'",
        ),
        (
            minimal(sources=[{"name": "a", "sampler": {"kind": "uniform", "beta": 1}}]),
            "sources.0.sampler",
            "beta: only for kind: priority",
        ),
        (
            minimal(sources=[{"name": "a", "sampler": {"kind": "prio"}}]),
            "sources.0.sampler.kind",
            "'uniform', 'priority', 'recent' or 'group'",
        ),
        (
            minimal(sources=[{"name": "a", "window": {"last_steps": 5, "max_age_s": 3}}]),
            "sources.0.window",
            "exactly one of last_steps, max_age_s",
        ),
        (
            minimal(sources=[{"name": "a", "window": {}}]),
            "sources.0.window",
            "exactly one",
        ),
        (minimal(sources=[{"name": "a"}, {"name": "a"}]), "", "duplicate names ['a']"),
        (
            minimal(sources=[{"name": "a", "weight": 100}, {"name": "b", "weight": 1}]),
            "",
            "'b' gets 0 of 8 rows",
        ),
        (minimal(prefetch={"depth": 4, "low_water": 4}), "prefetch", "below depth"),
        (minimal(augment={"action": [{"random_shift": None}]}), "", "augment.action: not one of"),
        (minimal(augment={"obs": [{"a": {}, "b": {}}]}), "augment", "one transform per entry"),
        (minimal(augment={"obs": "same"}), "augment", "'same' needs a field"),
        (minimal(rate_limit={"error_buffer": 1}), "rate_limit.samples_per_insert", "required"),
        (minimal(params={"x": {"a": 1}}), "params.x", "valid"),
        (
            minimal(sources=[{"name": "a", "where": "not " * 2000 + "terminated"}]),
            "sources.0.where",
            "CLAW_WHERE_MAX_DEPTH=32",
        ),
        (
            minimal(sources=[{"name": "a", "where": _nested_not(2000)}]),
            "sources.0.where",
            "CLAW_WHERE_MAX_DEPTH=32",
        ),
        # Each row's k neighbours are held in a prefetch worker serving other namespaces.
        (minimal(nearest={"k": 10**9}), "nearest.k", "at most 1024 (CLAW_NEAREST_MAX_K)"),
        (minimal(nearest={"k": 0}), "nearest.k", "greater than 0"),
        (minimal(layout={"dtypes": {"obs": "U3"}}), "layout.dtypes", "not a numeric dtype"),
        (minimal(layout={"dtypes": {"obs": "f99"}}), "layout.dtypes", "is not a dtype"),
        (minimal(layout={"dtypes": {"obs": ",4"}}), "layout.dtypes", "such as float32"),
        (minimal(layout={"dtypes": {"obs": ">f4"}}), "layout.dtypes", "without one ('float32')"),
        (minimal(layout={"dtypes": {"done": "f4"}}), "", "['done'] are not fields"),
        (minimal(layout={"parts": 3}), "", "must divide batch_size (8)"),
        (minimal(layout={"parts": 0}), "layout.parts", "greater than 0"),
    ],
)
def test_errors_name_the_key(data, where, message):
    text = error(data)
    assert message in text
    assert where in text


def test_layout_names_dtypes_of_the_fields_the_recipe_makes():
    r = Recipe.model_validate(
        minimal(n_step=3, layout={"dtypes": {"done": "float32", "obs": "<f8"}, "parts": 4})
    )
    assert r.layout.dtypes == {"done": "<f4", "obs": "<f8"} and r.layout.parts == 4
    grouped = minimal(sources=[{"name": "a", "sampler": {"kind": "group", "group_size": 2}}])
    assert "rows of independent draws" in error({**grouped, "layout": {"parts": 2}})


def test_validate_against_schema():
    r = Recipe.model_validate(
        minimal(
            fields=["obs", "next_obs", "prompt_ids", "tags.color", "episode_id"],
            sources=[
                {"name": "a", "where": {"tags.color": "red", "tags.difficulty": {"ge": "$d"}}},
            ],
            params={"d": 2},
        )
    )
    r.validate_against(Schema())


def test_validate_against_lists_every_problem():
    r = Recipe.model_validate(
        minimal(
            fields=["obs", "pixels", "color"],
            sources=[
                {"name": "a", "where": {"tags.shape": "round"}},
                {"name": "b", "where": {"tags.color": {"gt": 1}}},
                {"name": "c", "where": {"tags.difficulty": "$level"}},
            ],
            params={"level": "hard"},
        )
    )
    with pytest.raises(RecipeError) as e:
        r.validate_against(Schema())
    text = str(e.value)
    assert "fields: 'pixels' is not a field of the namespace" in text
    assert "fields: 'color' is not a field" in text  # tags are fields as tags.<name>
    assert "sources[0] (a).where.tags.shape: no tag 'shape'" in text
    assert "sources[1] (b).where.tags.color: operator 'gt' does not apply" in text
    assert "sources[2] (c).where.tags.difficulty: eq: expected a number, got 'hard'" in text


def test_validate_against_the_store_schema():
    from claw_tasks.format.schema import FieldSpec
    from claw_tasks.format.schema import Schema as StoreSchema

    schema = StoreSchema(fields={"obs": FieldSpec("<f4", (8,))}, tags={"color": "str"})
    r = Recipe.model_validate(minimal(sources=[{"name": "a", "where": {"tags.color": "red"}}]))
    r.validate_against(schema)
    bad = Recipe.model_validate(minimal(fields=["obs", "action_ids"]))
    with pytest.raises(RecipeError, match="'action_ids' is not a field"):
        bad.validate_against(schema)


def test_validate_against_knows_obs_action_next_obs_only_from_the_schema():
    llm = Schema(fields={"prompt_ids": None}, tags={})
    Recipe.model_validate(minimal(fields=["prompt_ids", "reward", "info"])).validate_against(llm)
    for name, message in [
        ("obs", "fields: 'obs' is not a field of the namespace"),
        ("action", "fields: 'action' is not a field of the namespace"),
        ("next_obs", "fields: 'next_obs' needs an 'obs' field in the namespace"),
    ]:
        with pytest.raises(RecipeError) as e:
            Recipe.model_validate(minimal(fields=["prompt_ids", name])).validate_against(llm)
        assert message in str(e.value)
    with_obs = Schema(fields={"obs": None}, tags={})
    Recipe.model_validate(minimal(fields=["obs", "next_obs"])).validate_against(with_obs)


@pytest.mark.parametrize(
    ("augment", "message"),
    [
        ({"obs": [{"random_shfit": {"pad": 4}}]}, "augment 'obs' op #0: unknown op 'random_shfit'"),
        ({"obs": [{"random_shift": {"pad": "4"}}]}, "random_shift: pad must be a non-negative"),
        ({"obs": [{"random_shift": {"padding": 4}}]}, "unknown params ['padding']"),
        (
            {"obs": [{"random_shift": None}, {"color_jitter": {"brightness": -1}}]},
            "augment 'obs' op #1: color_jitter: brightness",
        ),
    ],
)
def test_bad_augment_ops_fail_at_validation(augment, message):
    text = error(minimal(fields=["obs", "next_obs"], augment=augment))
    assert "augment" in text and message in text


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"sources": [{"name": "s", "sampler": {"kind": "group"}}]}, "group_size: required"),
        (
            {"sources": [{"name": "s", "sampler": {"kind": "uniform", "once": True}}]},
            "once: only for kind: group",
        ),
        (
            {
                "sources": [
                    {"name": "s", "sampler": {"kind": "group", "group_size": 2, "passes": 1}}
                ]
            },
            "passes: only with once",
        ),
        (
            {
                "sources": [
                    {"name": "s", "sampler": {"kind": "group", "group_size": 2}},
                    {"name": "u"},
                ]
            },
            "cannot be mixed",
        ),
        ({"fields": ["prompt_ids"], "tokens": {}}, "fields must include response_ids"),
        ({"sources": [{"name": "u"}], "tokens": {"mode": "trajectory"}}, "needs whole groups"),
    ],
)
def test_recipe_errors_name_the_cause(change, message):
    data = {**group_recipe().model_dump(exclude={"version"}), **change}
    with pytest.raises(ValueError, match=message):
        Recipe.model_validate(data)


def test_group_by_must_be_a_value_of_the_schema():
    from claw_tasks.format.schema import FieldSpec, Schema
    from orchestrator.recipe.base import RecipeError

    schema = Schema({"prompt_ids": FieldSpec("<i4", (None,))}, {"prompt_uid": "num"})
    r = group_recipe(group_by="terminated").model_copy(update={"fields": ["prompt_ids"]})
    with pytest.raises(RecipeError, match="group_by: terminated is a flag"):
        r.validate_against(schema)
    assert group_recipe().sources[0].sampler.group_by == "tags.prompt_uid"


def test_admission_derives_the_min_version_and_its_batch():
    """``admission`` keeps params.min_version at v - max_staleness (never below 0), so a
    where with $min_version moves with set_params; its batch counts trajectories."""
    grouped = group_recipe(k=2, n=4).model_dump()
    grouped["params"] = {"policy_version": 7}
    grouped["admission"] = {"max_staleness": 2}
    grouped["sources"][0]["where"] = "tags.min_version >= $min_version"
    r = Recipe.model_validate(grouped)
    assert r.params["min_version"] == 5 and r.admission_batch == 8 and r.group_size == 4
    grouped["params"]["policy_version"] = 1
    assert Recipe.model_validate(grouped).params["min_version"] == 0
    plain = Recipe.model_validate(
        minimal(params={"v": 3}, admission={"version_param": "v", "min_version_param": "lo"})
    )
    assert plain.params == {"v": 3, "lo": 3} and plain.admission_batch == 8
    assert (
        Recipe.model_validate(
            minimal(params={"policy_version": 0}, admission={"trajectories": 5})
        ).admission_batch
        == 5
    )
    assert "params.policy_version must be the trainer's current policy version" in error(
        minimal(admission={})
    )
    assert "must be the trainer's" in error(minimal(params={"policy_version": -1}, admission={}))
    assert "must differ" in error(
        minimal(params={"v": 1}, admission={"version_param": "v", "min_version_param": "v"})
    )
    assert "max_staleness" in error(
        minimal(params={"policy_version": 1}, admission={"max_staleness": -1})
    )
