"""The recipe model: a declarative description of the batches a trainer wants.

Every key, its default and what it produces is in ``docs/recipes.md``."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, Protocol, Self

import numpy as np
import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    SerializeAsAny,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    StringConstraints,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from claw_tasks.format.schema import LOG_PROB, VALUE, tag_key
from claw_tasks.where import AGE, FIXED, FilterError, Where
from orchestrator.recipe.joint import (
    JOINT_FIELDS,
    AgentWhere,
    Joint,
    joint_problem,
    joint_schema_problems,
)
from orchestrator.transforms.cleaning import RecipeClean
from orchestrator.transforms.framestack import stacked_shape

STACKED = ("obs", "next_obs")
"""The fields ``frame_stack`` stacks."""

RECORD_FIELDS = frozenset({"reward", "terminated", "truncated", "info"})
"""Fields every step record has, whatever the namespace schema (``obs``, ``action`` and the
other payload fields come from the schema; ``next_obs`` exists when ``obs`` does)."""

Name = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", max_length=128)]
Scalar = StrictStr | StrictInt | StrictFloat | StrictBool


def allocate(weights: Sequence[float], total: int) -> list[int]:
    """Split ``total`` by ``weights``: floors, then +1 by largest remainder (ties: first)."""
    w = np.asarray(weights, dtype=np.float64)
    quotas = w / w.sum() * total
    counts = np.floor(quotas).astype(np.int64)
    order = np.argsort(-(quotas - counts), kind="stable")
    counts[order[: total - int(counts.sum())]] += 1
    return counts.tolist()


class RecipeError(ValueError):
    """A recipe that does not fit the namespace schema; lists every offending key."""


class SchemaLike(Protocol):
    """What :meth:`Recipe.validate_against` needs from a namespace schema."""

    @property
    def fields(self) -> Mapping[str, Any]: ...  # payload field name -> spec

    @property
    def tags(self) -> Mapping[str, str]: ...  # free tag name -> 'str' | 'num'


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Window(_Model):
    """Restrict a source to its newest candidates: exactly one of the two keys."""

    last_steps: PositiveInt | None = None
    max_age_s: PositiveFloat | None = None

    @model_validator(mode="after")
    def _one(self) -> Self:
        if (self.last_steps is None) == (self.max_age_s is None):
            raise ValueError("window takes exactly one of last_steps, max_age_s")
        return self


DEFAULT_SAMPLER = "uniform"
"""The ``sampler.kind`` of a source that names none."""

SAMPLER_KINDS: dict[str, type[SamplerSpec]] = {}
"""The keys of each ``sampler.kind``, in registration order. The recipe names no kind
itself: each sampler of :mod:`orchestrator.sampling.samplers` registers its spec with its
class (the ``orchestrator`` package imports every sampler before any recipe is read), so a
new sampler is one new file there."""


class SamplerSpec(_Model):
    """How a source draws its rows: ``kind`` and that kind's keys. Each kind is a subclass
    (its ``kind`` a one-value ``Literal``) registered in :data:`SAMPLER_KINDS`; a key left
    out or null takes the kind's default, a key of another kind is an error."""

    kind: str = DEFAULT_SAMPLER
    draws_groups: ClassVar[bool] = False
    """Whether a source's count is in whole groups (its rows: every step of them)."""

    @field_validator("kind")
    @classmethod
    def _known(cls, kind: str) -> str:
        if kind not in SAMPLER_KINDS:
            names = [repr(k) for k in SAMPLER_KINDS]
            expected = " or ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)
            raise PydanticCustomError(
                "literal_error", "Input should be {expected}", {"expected": expected}
            )
        return kind

    def problems(self, tags: Mapping[str, str]) -> list[str]:
        """What is wrong with the keys against a namespace's free ``tags`` (``key: why``)."""
        return []


def parse_sampler(data: Mapping[str, Any]) -> SamplerSpec:
    """The spec of ``data``'s kind, validated (a null key is an absent one)."""
    kind = data.get("kind", DEFAULT_SAMPLER)
    spec = SAMPLER_KINDS.get(kind) if isinstance(kind, str) else None
    if spec is None:
        return SamplerSpec.model_validate({"kind": kind})  # raises, naming the kinds
    given = {k: v for k, v in data.items() if v is not None}
    for other, keys in SAMPLER_KINDS.items():
        extra = [k for k in keys.model_fields if k in given and k not in spec.model_fields]
        if extra:
            raise ValueError(f"{', '.join(extra)}: only for kind: {other}")
    return spec.model_validate(given)


def register_kind(spec: type[SamplerSpec]) -> str:
    """Make ``spec`` the keys of its ``kind`` (its ``kind`` field's default); returns it."""
    kind = spec.model_fields["kind"].default
    if kind in SAMPLER_KINDS and SAMPLER_KINDS[kind] is not spec:
        raise ValueError(f"sampler kind {kind!r} is registered twice")
    SAMPLER_KINDS[kind] = spec
    return kind


def _default_sampler() -> SamplerSpec:
    return SAMPLER_KINDS[DEFAULT_SAMPLER]()


class Source(_Model):
    """One component of the mixture. ``where`` is either form of the where language."""

    name: Name
    weight: PositiveFloat = 1.0
    where: StrictStr | dict[str, Any] = {}
    window: Window | None = None
    sampler: SerializeAsAny[SamplerSpec] = Field(default_factory=_default_sampler)
    any_agent: AgentWhere = None  # joint recipes: some present agent's step matches
    all_agents: AgentWhere = None  # joint recipes: every present agent's step matches

    @field_validator("where")
    @classmethod
    def _where(cls, where: str | dict[str, Any]) -> str | dict[str, Any]:
        try:
            keys = Where(where).keys
        except FilterError as e:
            raise ValueError(str(e)) from None
        if AGE.name in keys:  # a sampler keeps its candidates; they must not age by the clock
            raise ValueError("age: a source filters by age with window: {max_age_s: <seconds>}")
        return where

    @field_validator("sampler", mode="wrap")
    @classmethod
    def _sampler(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> SamplerSpec:
        return parse_sampler(value) if isinstance(value, Mapping) else handler(value)

    def where_error(self, i: int, tags: Mapping[str, str] | None, params: Mapping) -> str | None:
        """What is wrong with the where against ``tags`` and ``params``, or None."""
        try:
            Where(self.where, tags).key(params)
        except FilterError as e:
            sep = ": " if isinstance(self.where, str) else "."
            return f"sources[{i}] ({self.name}).where{sep}{e}"
        return None


class Prefetch(_Model):
    """Queue depth, and the level below which a pop asks for a refill (default depth/2)."""

    depth: PositiveInt = 8
    low_water: NonNegativeInt | None = None

    @model_validator(mode="after")
    def _low_water(self) -> Self:
        if self.low_water is None:
            self.low_water = self.depth // 2
        elif self.low_water >= self.depth:
            raise ValueError(f"low_water ({self.low_water}) must be below depth ({self.depth})")
        return self


class RateLimit(_Model):
    """Samples per inserted step, with slack ``error_buffer``, once ``min_size`` steps exist."""

    samples_per_insert: PositiveFloat
    error_buffer: NonNegativeFloat = 100.0
    min_size: PositiveInt = 1


TOKEN_FIELDS = ("prompt_ids", "response_ids", "response_logprobs")
"""The fields a ``tokens`` recipe must ask for (``response_mask`` is used when asked for)."""


class Tokens(_Model):
    """Collation of LLM turns into token batches (docs/recipes.md, "Token batches")."""

    mode: Literal["transition", "trajectory"] = "transition"
    padding_side: Literal["right", "left"] = "right"
    pad_multiple: PositiveInt = 1
    pad_token_id: NonNegativeInt = 0
    max_tokens: PositiveInt | None = None
    advantage: Literal["grpo", "dr_grpo", "none"] | None = None
    eps: NonNegativeFloat = 1e-6


ROLLOUT_FIELDS = ("advantages", "returns", "log_prob", "value", "policy_version")
"""What a rollout recipe's minibatches carry besides its ``fields``."""


class Rollout(_Model):
    """On-policy delivery: the steps of one policy version, consumed once, as ``epochs``
    passes of shuffled minibatches with advantages (docs/recipes.md, "On-policy")."""

    steps: PositiveInt
    epochs: PositiveInt = 1
    version_param: Name = "policy_version"
    max_lag: NonNegativeInt = 0
    advantage: Literal["gae", "vtrace"] = "gae"
    gae_lambda: float = Field(0.95, ge=0.0, le=1.0)
    normalize: StrictBool = True
    rho_bar: PositiveFloat = 1.0
    c_bar: PositiveFloat = 1.0
    scorer: StrictStr | None = None

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if self.scorer is not None and ":" not in self.scorer:
            raise ValueError(f"scorer {self.scorer!r}: name it as 'module:function'")
        if self.advantage == "vtrace" and self.max_lag > 0 and self.scorer is None:
            raise ValueError(
                "advantage: vtrace with max_lag > 0 needs the target policy's log-probs and "
                "values of the older steps: name a scorer (module:function, allowed by the "
                "workers' CLAW_SCORERS)"
            )
        if self.scorer is not None and self.advantage != "vtrace":
            raise ValueError("scorer: only with advantage: vtrace")
        return self


class Admission(_Model):
    """Staleness-bounded generation (docs/llm.md, "Admission"): the capture gateway starts
    a new trajectory only while ``admitted <= (max_staleness + v + 1) * trajectories``,
    v being ``params[version_param]`` (the trainer's current policy version, moved by
    ``set_params``); ``params[min_version_param]`` is kept at ``max(0, v - max_staleness)``
    for the sources' ``where`` (``tags.min_version >= $min_version``: nothing older is
    served)."""

    max_staleness: NonNegativeInt = 0
    version_param: Name = "policy_version"
    min_version_param: Name = "min_version"
    trajectories: PositiveInt | None = None
    """Trajectories per batch (default: ``batch_size`` x the group sampler's ``group_size``,
    or ``batch_size``)."""


class Nearest(_Model):
    """Attach each row's ``k`` nearest steps of a vector index (docs/retrieval.md): the
    prefetch workers query the index with the row's ``query`` field (as drawn, before
    augmentation) and add ``nearest.<field>`` (B, k, ...), ``nearest.id`` and
    ``nearest.distance`` (B, k) to the batch."""

    index: Name = "default"
    namespace: StrictStr | None = None  # another namespace's index (an expert dataset)
    k: PositiveInt = 1
    query: StrictStr = "obs"
    where: StrictStr | dict[str, Any] = {}
    fields: list[StrictStr] = ["action"]
    exclude_self: StrictBool = True
    """Drop a row's own step from its neighbours (a row drawn from the indexed steps)."""


class Recipe(_Model):
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
        for src, n in zip(self.sources, self.counts, strict=True):
            if n == 0:
                raise ValueError(
                    f"sources: {src.name!r} gets 0 of {self.batch_size} rows at weight "
                    f"{src.weight}; raise its weight or the batch size"
                )
        return self

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


RecipeLike = Recipe | Mapping[str, Any] | str | Path
"""A recipe, its dict form, or the path of its YAML file."""


def as_recipe(recipe: RecipeLike) -> Recipe:
    """A validated :class:`Recipe` from any :data:`RecipeLike`."""
    if isinstance(recipe, Recipe):
        return recipe
    if isinstance(recipe, str | Path):
        return Recipe.from_yaml(recipe)
    return Recipe.model_validate(dict(recipe))
