"""Sampler kinds come from one registry: the recipe accepts exactly the registered kinds
and their keys, and a new kind is one class with ``@register`` (no service needed)."""

from __future__ import annotations

import subprocess
import sys
from typing import Literal

import numpy as np
import pytest
from pydantic import PositiveInt, ValidationError

from orchestrator.recipe.model import Recipe
from orchestrator.recipe.sources import SAMPLER_KINDS, SamplerSpec
from orchestrator.sampling.candidates import Columns
from orchestrator.sampling.samplers import SAMPLERS, Context, Part, RecipeSampler, Sampler, register
from tests.support.paths import ROOT


def recipe(sampler: dict) -> dict:
    return {
        "name": "r",
        "batch_size": 4,
        "fields": ["obs"],
        "sources": [{"name": "a", "sampler": sampler}],
    }


def test_the_recipe_accepts_the_registered_kinds_in_order():
    assert list(SAMPLERS) == list(SAMPLER_KINDS) == ["uniform", "priority", "recent", "group"]
    for kind, cls in SAMPLERS.items():
        assert SAMPLER_KINDS[kind] is cls.Spec
        spec = (
            Recipe.model_validate(
                recipe({"kind": kind, "group_size": 2} if kind == "group" else {"kind": kind})
            )
            .sources[0]
            .sampler
        )
        assert type(spec) is cls.Spec


def test_every_kinds_keys_are_documented():
    text = (ROOT / "docs" / "recipes.md").read_text()
    for kind, spec in SAMPLER_KINDS.items():
        assert f"`{kind}`" in text
        missing = [k for k in spec.model_fields if f"`{k}`" not in text]
        assert not missing, f"sampler {kind!r} keys not in docs/recipes.md: {missing}"


def test_a_dump_with_every_kinds_keys_null_still_loads():
    """Recipes dumped before the kinds were classes (the registry in Redis keeps them)
    carry every kind's keys, null where unused."""
    old = {
        "kind": "uniform",
        "alpha": None,
        "beta": None,
        "group_by": None,
        "group_size": None,
        "max_wait_s": None,
        "partial": None,
        "once": None,
        "passes": None,
    }
    r = Recipe.model_validate(recipe(old))
    assert r == Recipe.model_validate(recipe({}))
    assert r.sources[0].sampler.model_dump() == {"kind": "uniform"}
    p = Recipe.model_validate(recipe({**old, "kind": "priority", "alpha": 0.9})).sources[0]
    assert (p.sampler.alpha, p.sampler.beta) == (0.9, 0.4)


def test_importing_the_recipe_alone_registers_the_kinds():
    code = (
        "from orchestrator.recipe.model import Recipe\n"
        "r = Recipe.model_validate({'name': 'r', 'batch_size': 2, 'fields': ['obs'],"
        " 'sources': [{'name': 'a', 'sampler': {'kind': 'priority'}}]})\n"
        "assert r.sources[0].sampler.alpha == 0.6\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


class EveryOtherSpec(SamplerSpec):
    kind: Literal["every_other"] = "every_other"
    stride: PositiveInt = 2


class EveryOther(Sampler):
    """The first ``k`` candidates of every ``stride``-th row: a kind made in a test."""

    Spec = EveryOtherSpec

    def draw(self, columns: Columns, k: int, ctx: Context) -> Part:
        self.candidates(columns, ctx.params)
        assert self.cand is not None and isinstance(self.spec, EveryOtherSpec)
        rows = np.flatnonzero(self.cand)[:: self.spec.stride][:k]
        return Part(rows, np.ones(k, np.float32))


@pytest.fixture
def every_other():
    register(EveryOther)
    yield
    del SAMPLERS["every_other"], SAMPLER_KINDS["every_other"]


def test_a_new_kind_is_one_registered_class(every_other):
    r = Recipe.model_validate(recipe({"kind": "every_other", "stride": 3}))
    assert r.sources[0].sampler == EveryOtherSpec(stride=3)
    n = 64
    columns = {
        "alive": np.ones(n, bool),
        "flags": np.zeros(n, np.int32),
        "id": np.arange(1, n + 1, dtype=np.int64),
    }
    sampler = RecipeSampler(r, lambda column, names: np.zeros(len(names)), {}, n)
    draw = sampler.sample(columns, np.random.default_rng(0))
    assert draw.rows.tolist() == [0, 3, 6, 9]
    with pytest.raises(ValidationError, match="stride: only for kind: every_other"):
        Recipe.model_validate(recipe({"kind": "uniform", "stride": 3}))
    with pytest.raises(ValidationError, match="'recent', 'group' or 'every_other'"):
        Recipe.model_validate(recipe({"kind": "nope"}))


def test_a_kind_registers_once(every_other):
    class Again(EveryOther):
        pass

    with pytest.raises(ValueError, match="registered twice"):
        register(Again)
