"""The recipe model: a declarative description of the batches a trainer wants, and its
checks against itself and a namespace schema. Its sections are in ``base``, ``sources``
and ``options``.

Every key, its default and what it produces is in ``docs/recipes.md``."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal, Self

import numpy as np
import yaml
from pydantic import Field, PositiveInt, field_validator, model_validator

from claw_tasks.format.schema import LOG_PROB, VALUE, tag_key
from claw_tasks.where import FIXED
from orchestrator.recipe.base import Name, RecipeError, Scalar, SchemaLike, StrictModel, allocate
from orchestrator.recipe.joint import JOINT_FIELDS, Joint, joint_problem, joint_schema_problems
from orchestrator.recipe.options import (
    ROLLOUT_FIELDS,
    TOKEN_FIELDS,
    Admission,
    Layout,
    Nearest,
    Prefetch,
    RateLimit,
    Rollout,
    Tokens,
)

# SamplerSpec and register_kind: orchestrator/sampling/samplers/ imports them from here.
from orchestrator.recipe.sources import DEFAULT_SAMPLER, SamplerSpec, Source, register_kind
from orchestrator.transforms.cleaning import RecipeClean
from orchestrator.transforms.framestack import stacked_shape

__all__ = [
    "RECORD_FIELDS",
    "STACKED",
    "Recipe",
    "RecipeLike",
    "Rollout",
    "SamplerSpec",
    "Source",
    "as_recipe",
    "recipe_digest",
    "register_kind",
    "same_recipe",
]

STACKED = ("obs", "next_obs")
"""The fields ``frame_stack`` stacks."""

N_STEP_FIELDS = ("discount", "done", "end_truncated")
"""The fields ``n_step`` > 1 adds to a recipe's."""

RECORD_FIELDS = frozenset({"reward", "terminated", "truncated", "info"})
"""Fields every step record has, whatever the namespace schema (``obs``, ``action`` and the
other payload fields come from the schema; ``next_obs`` exists when ``obs`` does)."""


class Recipe(StrictModel):
    """A validated recipe. Build with :meth:`from_yaml` or :meth:`model_validate`."""

    name: Name
    batch_size: PositiveInt
    fields: list[str] = Field(min_length=1)
    sources: list[Source] = Field(min_length=1)
    params: dict[str, Scalar | list[Scalar]] = {}
    n_step: PositiveInt = 1
    gamma: float = Field(0.99, gt=0.0, le=1.0)
    sequence_length: PositiveInt = 1
    frame_stack: PositiveInt = 1
    augment: dict[str, list[dict[str, dict[str, Any] | None]] | Literal["same"]] = {}
    prefetch: Prefetch = Prefetch()
    rate_limit: RateLimit | None = None
    tokens: Tokens | None = None
    joint: Joint | None = None
    rollout: Rollout | None = None
    nearest: Nearest | None = None
    admission: Admission | None = None
    layout: Layout | None = None
    """Dtypes and row order of the delivered batch (what an adapter's trainer wraps)."""
    clean: RecipeClean | None = None
    """Mapping, validity rules and outliers checked on every drawn batch in the prefetch
    workers (docs/retrieval.md, "Cleaning"): a failing step is quarantined, the batch
    drawn again."""
    seed: int | None = None
    as_of: Name | None = None
    """Sample a snapshot of the namespace (``claw snapshot NS NAME``): only its steps that
    are still stored, with its labels, priorities and tags."""
    version: PositiveInt = 1

    @classmethod
    def from_yaml(cls, path: str | Path) -> Recipe:
        """Load and validate a recipe from a YAML file."""
        data = yaml.safe_load(Path(path).read_text())
        if not isinstance(data, dict):
            raise ValueError(f"{path}: a recipe is a YAML mapping")
        return cls.model_validate(data)

    @field_validator("fields")
    @classmethod
    def _unique_fields(cls, fields: list[str]) -> list[str]:
        dup = sorted({f for f in fields if fields.count(f) > 1})
        if dup:
            raise ValueError(f"duplicate fields: {dup}")
        return fields

    @field_validator("augment")
    @classmethod
    def _augment(cls, augment: dict[str, Any]) -> dict[str, Any]:
        for field, steps in augment.items():
            for i, step in enumerate([] if steps == "same" else steps):
                if len(step) != 1:
                    raise ValueError(f"{field}[{i}]: one transform per entry, got {list(step)}")
        if augment and all(v == "same" for v in augment.values()):
            raise ValueError("'same' needs a field with its own transforms")
        # Build the pipelines once so an unknown op or bad params fail at registration,
        # not in every prefetch. Imported here: augment pulls in OpenCV.
        from orchestrator.transforms.augment import build_pipelines

        build_pipelines(augment)  # ValueError naming the field, op and param
        return augment

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        self._admission_consistent()  # first: it sets a param the sources' where may use
        names = [s.name for s in self.sources]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"sources: duplicate names {dup}")
        for key in self.augment:
            if key not in self.fields:
                raise ValueError(f"augment.{key}: not one of the recipe's fields")
        for i, src in enumerate(self.sources):
            if problem := src.where_error(i, None, self.params):
                raise ValueError(problem)
        self._groups_consistent()
        moved = [s.name for s in self.sources if s.transition is not None]
        if moved and (self.grouped or self.joint is not None or self.rollout is not None):
            raise ValueError(
                f"sources {moved}: transition selects steps; not with group sources, joint "
                "or rollout recipes"
            )
        if problem := joint_problem(self):
            raise ValueError(problem)
        self._rollout_consistent()
        near = self.nearest
        if near is not None and near.query not in self.fields:
            raise ValueError(f"nearest.query: {near.query!r} is not one of the recipe's fields")
        if near is not None and (self.sequence_length > 1 or self.grouped or self.frame_stack > 1):
            raise ValueError("nearest: rows of one step each (no sequences, groups, stacks)")
        if self.clean is not None:
            self._clean_consistent(self.clean)
        if self.layout is not None:
            self._layout_consistent(self.layout)
        for src, n in zip(self.sources, self.counts, strict=True):
            if n == 0:
                raise ValueError(
                    f"sources: {src.name!r} gets 0 of {self.batch_size} rows at weight "
                    f"{src.weight}; raise its weight or the batch size"
                )
        return self

    def _layout_consistent(self, layout: Layout) -> None:
        made = set(self.fields) | (set(N_STEP_FIELDS) if self.n_step > 1 else set())
        unknown = sorted(set(layout.dtypes) - made)
        if unknown:
            raise ValueError(
                f"layout.dtypes: {unknown} are not fields of the recipe: name fields of "
                f"{sorted(made)}, or add them to `fields`"
            )
        if self.batch_size % layout.parts:
            raise ValueError(
                f"layout.parts ({layout.parts}) must divide batch_size ({self.batch_size})"
            )
        if layout.parts > 1 and (self.grouped or self.tokens is not None or self.rollout):
            raise ValueError(
                "layout.parts: rows of independent draws only: drop `layout.parts`, or the "
                "group sources, `tokens` or `rollout`"
            )

    def _clean_consistent(self, clean: RecipeClean) -> None:
        unknown = sorted(clean.names() - set(self.fields))
        if unknown:
            raise ValueError(f"clean: {unknown} are not fields of the recipe")
        if self.sequence_length > 1 or self.grouped or self.frame_stack > 1 or self.tokens:
            raise ValueError("clean: rows of one step each (no sequences, groups, stacks, tokens)")
        if self.rollout is not None or self.joint is not None:
            raise ValueError("clean: not with rollout or joint recipes")

    @property
    def grouped(self) -> bool:
        """Whether the recipe draws whole groups (its sources are ``kind: group``)."""
        return self.sources[0].sampler.draws_groups

    def _groups_consistent(self) -> None:
        kinds = {s.sampler.draws_groups for s in self.sources}
        if len(kinds) > 1:
            raise ValueError("sources: kind: group cannot be mixed with other samplers")
        if self.grouped and (self.n_step > 1 or self.sequence_length > 1):
            raise ValueError("kind: group draws whole trajectories: n_step and sequence_length 1")
        if self.frame_stack > 1 and (self.grouped or self.sequence_length > 1):
            raise ValueError(
                "frame_stack stacks one step's frames: sequence_length 1 and no group sources "
                "(a window of L steps already holds L frames)"
            )
        tok = self.tokens
        if tok is None:
            return
        missing = [f for f in TOKEN_FIELDS if f not in self.fields]
        if missing:
            raise ValueError(f"tokens: fields must include {', '.join(missing)}")
        if self.sequence_length > 1 or self.n_step > 1:
            raise ValueError("tokens: collates single turns: n_step and sequence_length 1")
        if tok.advantage is None:
            tok.advantage = "grpo" if self.grouped else "none"
        if not self.grouped and (tok.mode == "trajectory" or tok.advantage != "none"):
            raise ValueError(
                f"tokens: mode {tok.mode} with advantage {tok.advantage} needs whole groups: "
                "give the sources sampler: {kind: group, group_size: n}"
            )

    def _rollout_consistent(self) -> None:
        ro = self.rollout
        if ro is None:
            return
        others = [
            k
            for k, off in (
                ("n_step", self.n_step == 1),
                ("sequence_length", self.sequence_length == 1),
                ("frame_stack", self.frame_stack == 1),
                ("tokens", self.tokens is None),
                ("joint", self.joint is None),
                ("rate_limit", self.rate_limit is None),
            )
            if not off
        ]
        if others:
            raise ValueError(f"rollout: serves single steps once; not with {', '.join(others)}")
        src = self.sources[0]
        if len(self.sources) != 1 or src.sampler.kind != DEFAULT_SAMPLER or src.window:
            raise ValueError(
                "rollout: one source, without a sampler or window (its where picks the "
                "candidates; rollouts take each of them once)"
            )
        if ro.steps % self.batch_size:
            raise ValueError(
                f"rollout.steps ({ro.steps}) must be a multiple of batch_size "
                f"({self.batch_size}): every minibatch has batch_size steps"
            )
        v = self.params.get(ro.version_param)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(
                f"rollout: params.{ro.version_param} must be the policy version to serve, an "
                f"int >= 0 (set_params moves it), not {v!r}"
            )
        clash = sorted(set(self.fields) & set(ROLLOUT_FIELDS[:4]))
        if clash:
            raise ValueError(f"fields: {clash} are added by rollout; leave them out")

    def _admission_consistent(self) -> None:
        adm = self.admission
        if adm is None:
            return
        if self.rollout is not None:
            raise ValueError("admission: not with rollout (it serves one policy version)")
        if adm.version_param == adm.min_version_param:
            raise ValueError("admission: version_param and min_version_param must differ")
        v = self.params.get(adm.version_param)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(
                f"admission: params.{adm.version_param} must be the trainer's current policy "
                f"version, an int >= 0 (set_params moves it), not {v!r}"
            )
        self.params[adm.min_version_param] = max(0, v - adm.max_staleness)

    @property
    def group_size(self) -> int:
        """Trajectories per group of a group recipe (1 otherwise)."""
        return int(getattr(self.sources[0].sampler, "group_size", None) or 1)

    @property
    def admission_batch(self) -> int:
        """Trajectories per batch, as admission counts them."""
        adm = self.admission
        if adm is not None and adm.trajectories is not None:
            return adm.trajectories
        return self.batch_size * (self.group_size if self.grouped else 1)

    @property
    def counts(self) -> list[int]:
        """Rows per source in every batch (largest-remainder rounding of the weights)."""
        return allocate([s.weight for s in self.sources], self.batch_size)

    def validate_against(self, schema: SchemaLike) -> None:
        """Check fields, ``where`` keys and param types against a namespace schema."""
        known = set(RECORD_FIELDS) | set(FIXED) | set(schema.fields)
        known |= {tag_key(t) for t in schema.tags}
        if "obs" in schema.fields:
            known.add("next_obs")
        if self.joint is not None:
            known |= JOINT_FIELDS
        problems = joint_schema_problems(self, schema.fields, schema.tags)
        if self.frame_stack > 1 and not _stackable(schema):
            problems.append(
                "frame_stack: needs a fixed-shape 'obs' field in the namespace (it stacks obs "
                "and next_obs)"
            )
        for f in self.fields:
            if f == "next_obs" and f not in known:
                problems.append("fields: 'next_obs' needs an 'obs' field in the namespace")
            elif f not in known:
                problems.append(f"fields: {f!r} is not a field of the namespace")
        for i, src in enumerate(self.sources):
            if problem := src.where_error(i, schema.tags, self.params):
                problems.append(problem)
        for i, src in enumerate(self.sources):
            problems += [
                f"sources[{i}] ({src.name}).sampler.{p}" for p in src.sampler.problems(schema.tags)
            ]
        problems += self._augment_problems(schema)
        for name in sorted(self.clean.names()) if self.clean is not None else []:
            if getattr(schema.fields.get(name), "ragged", False):
                problems.append(f"clean: {name!r} is ragged; rules read fixed-shape fields")
        if self.rollout is not None:
            missing = [t for t in (LOG_PROB, VALUE) if schema.tags.get(t) != "num"]
            if missing:  # bootstrap_value may not be there yet: no segment ended so far
                problems.append(
                    f"rollout: the namespace needs the numeric tags {', '.join(missing)} "
                    "(Schema.rollout; actors record them with each step)"
                )
        if problems:
            raise RecipeError(f"recipe {self.name!r}: " + "; ".join(problems))

    def _augment_problems(self, schema: SchemaLike) -> list[str]:
        """Run every augment op once on two zero rows of its field's stored dtype and shape:
        an op that cannot apply (e.g. ``random_shift`` on a vector) fails at registration,
        not in every prefetch. Ragged fields are left to the ops at run time."""
        if not self.augment:
            return []
        from orchestrator.transforms.augment import build_pipelines

        plan = build_pipelines(self.augment)
        problems = []
        for field in self.augment:
            spec = _stored(field, schema)
            if spec is None:
                continue
            dtype, shape = spec
            if self.frame_stack > 1 and field in STACKED:
                shape = stacked_shape(shape, self.frame_stack)
            rows = (2, self.sequence_length) if self.sequence_length > 1 else (2,)
            x = np.zeros((*rows, *shape), dtype)
            pipeline = plan.pipelines.get(field) or plan.pipelines[plan.aliases[field]]
            for op in pipeline.ops:
                try:
                    op.observe(x)
                    x = op(x, np.random.default_rng(0))
                except ValueError as e:
                    problems.append(
                        f"augment.{field}: {op.name} cannot apply to field {field!r} of shape "
                        f"{tuple(shape)} ({np.dtype(dtype).name}): {e}"
                    )
                    break
        return problems


def _stackable(schema: SchemaLike) -> bool:
    spec = schema.fields.get("obs")
    return spec is not None and not getattr(spec, "ragged", False)


def _stored(field: str, schema: SchemaLike) -> tuple[str, tuple[int, ...]] | None:
    """(dtype, shape) of one row of ``field`` as a batch holds it; None when ragged or
    unknown."""
    name = "obs" if field == "next_obs" else field
    if name in schema.fields:
        spec = schema.fields[name]
        if getattr(spec, "dtype", None) is None or spec.ragged:  # names only, or ragged
            return None
        return spec.dtype, tuple(spec.shape)
    return {"reward": ("<f4", ()), "terminated": ("|b1", ()), "truncated": ("|b1", ())}.get(name)


def same_recipe(a: Recipe, b: Recipe, ignore: Iterable[str] = ("version",)) -> bool:
    """Whether ``a`` and ``b`` are equal but for the top-level keys in ``ignore`` (e.g.
    ``version``, or ``params``, which are live)."""
    skip = set(ignore)
    return a.model_dump(exclude=skip) == b.model_dump(exclude=skip)


def recipe_digest(recipe: Recipe) -> str:
    """The content address of what a recipe version makes of the steps it draws: its JSON
    form without ``version`` and the live ``params`` (blake2b, 8 bytes as hex). A lineage
    entry names the recipe that made its batch by it (with the version apart). The params
    only choose what is drawn (the entry records the ids drawn), so a trainer that sets
    them every update (an admission's ``policy_version``) adds no definition to keep; a
    recipe dropped and registered again with other content is never mistaken for the one
    before."""
    data = recipe.model_dump(mode="json", exclude={"version", "params"})
    text = json.dumps(data, sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


RecipeLike = Recipe | Mapping[str, Any] | str | Path
"""A recipe, its dict form, or the path of its YAML file."""


def as_recipe(recipe: RecipeLike) -> Recipe:
    """A validated :class:`Recipe` from any :data:`RecipeLike`."""
    if isinstance(recipe, Recipe):
        return recipe
    if isinstance(recipe, str | Path):
        return Recipe.from_yaml(recipe)
    return Recipe.model_validate(dict(recipe))
