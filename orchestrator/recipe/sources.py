"""A recipe's sources: each one's where, window and sampler spec, and the registry of
sampler kinds the samplers fill (:data:`SAMPLER_KINDS`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Self

from pydantic import (
    ConfigDict,
    Field,
    PositiveFloat,
    PositiveInt,
    SerializeAsAny,
    StrictStr,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from claw_tasks.where import AGE, FilterError, Where
from orchestrator.recipe.base import Name, StrictModel
from orchestrator.recipe.joint import AgentWhere


class Window(StrictModel):
    """Restrict a source to its newest candidates: exactly one of the two keys."""

    last_steps: PositiveInt | None = None
    max_age_s: PositiveFloat | None = None

    @model_validator(mode="after")
    def _one(self) -> Self:
        if (self.last_steps is None) == (self.max_age_s is None):
            raise ValueError("window takes exactly one of last_steps, max_age_s")
        return self


class Transition(StrictModel):
    """``transition: {from: A, to: B, window: k}``: only the steps within ``k`` steps of a
    change of ``skill_tag`` from A to B inside an episode (the k up to it and the k from
    it; :mod:`orchestrator.sampling.transitions`)."""

    model_config = ConfigDict(
        extra="forbid", validate_by_name=True, validate_by_alias=True, serialize_by_alias=True
    )

    from_skill: StrictStr = Field(alias="from", min_length=1, max_length=1024)
    to_skill: StrictStr = Field(alias="to", min_length=1, max_length=1024)
    window: PositiveInt = 1

    @model_validator(mode="after")
    def _differ(self) -> Self:
        if self.from_skill == self.to_skill:
            raise ValueError(f"transition: from and to are both {self.from_skill!r}")
        if self.window > 64:
            raise ValueError(f"transition.window: at most 64 steps, not {self.window}")
        return self


DEFAULT_SAMPLER = "uniform"
"""The ``sampler.kind`` of a source that names none."""

SAMPLER_KINDS: dict[str, type[SamplerSpec]] = {}
"""The keys of each ``sampler.kind``, in registration order. The recipe names no kind
itself: each sampler of :mod:`orchestrator.sampling.samplers` registers its spec with its
class (the ``orchestrator`` package imports every sampler before any recipe is read), so a
new sampler is one new file there."""


class SamplerSpec(StrictModel):
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


def default_sampler() -> SamplerSpec:
    """A spec of the default kind, with its defaults."""
    return SAMPLER_KINDS[DEFAULT_SAMPLER]()


class Source(StrictModel):
    """One component of the mixture. ``where`` is either form of the where language."""

    name: Name
    weight: PositiveFloat = 1.0
    where: StrictStr | dict[str, Any] = {}
    window: Window | None = None
    transition: Transition | None = None
    sampler: SerializeAsAny[SamplerSpec] = Field(default_factory=default_sampler)
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
