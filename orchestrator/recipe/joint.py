"""The joint mode of a recipe: a batch row is one joint time step of multi-agent data
(:mod:`claw_tasks.format.joint` says how the records of one are tied together; what a
joint batch holds is in docs/recipes.md, "Joint batches").

A joint recipe names its agents in a fixed order (``joint: {agents: [...]}``); its
sources' ``where`` select joint steps by their anchor record (the global state's tags,
``step_index``, what every agent of the step shares), and ``any_agent`` / ``all_agents``
by their agents' own steps: some present agent's step matches, every present agent's
step matches."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Protocol

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictStr, StringConstraints

from claw_tasks.format.joint import STATE_FIELD
from claw_tasks.where import AGE, FilterError, Where

JOINT_FIELDS = frozenset({STATE_FIELD, "next_state", "team_reward", "mask", "step_ids"})
"""Fields of a joint batch that are the joint step's, not an agent's: the global state
(``state``, ``next_state``), the team reward, the presence mask and each agent's step id."""

AgentName = Annotated[str, StringConstraints(min_length=1, max_length=256)]


def _agent_where(where: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if where is None:
        return None
    try:
        keys = Where(where).keys
    except FilterError as e:
        raise ValueError(str(e)) from None
    if AGE.name in keys:
        raise ValueError("age: a source filters by age with window: {max_age_s: <seconds>}")
    return where


AgentWhere = Annotated[StrictStr | dict[str, Any] | None, AfterValidator(_agent_where)]
"""A where over each agent's own step of a joint step (``any_agent``, ``all_agents``)."""


class Joint(BaseModel):
    """``joint: {agents: [...]}``: batch rows are joint steps; per-agent fields are
    ``(B, len(agents), ...)`` in this order."""

    model_config = ConfigDict(extra="forbid")

    agents: list[AgentName] = Field(min_length=1)


class JointRecipe(Protocol):
    """What the checks read of a recipe (:class:`orchestrator.recipe.model.Recipe`)."""

    # Read-only (properties): a recipe's attributes may be narrower than these types.
    @property
    def joint(self) -> Joint | None: ...
    @property
    def sources(self) -> Any: ...
    @property
    def fields(self) -> Sequence[str]: ...
    @property
    def params(self) -> Mapping[str, Any]: ...
    @property
    def n_step(self) -> int: ...
    @property
    def sequence_length(self) -> int: ...
    @property
    def frame_stack(self) -> int: ...
    @property
    def tokens(self) -> Any: ...


def joint_problem(recipe: JointRecipe) -> str | None:
    """What is wrong with a recipe's joint keys on their own, or None."""
    agent_wheres = [
        (i, s.name, k)
        for i, s in enumerate(recipe.sources)
        for k in ("any_agent", "all_agents")
        if getattr(s, k) is not None
    ]
    if recipe.joint is None:
        if agent_wheres:
            i, name, k = agent_wheres[0]
            return f"sources[{i}] ({name}).{k}: only in a joint recipe (joint: {{agents: [...]}})"
        return None
    agents = recipe.joint.agents
    dup = sorted({a for a in agents if agents.count(a) > 1})
    if dup:
        return f"joint.agents: duplicate agents {dup}"
    if recipe.n_step > 1 or recipe.sequence_length > 1 or recipe.frame_stack > 1:
        return "joint: rows are single joint steps (n_step, sequence_length, frame_stack 1)"
    if recipe.tokens is not None:
        return "joint: no tokens section (token batches are single-agent turns)"
    for i, s in enumerate(recipe.sources):
        if s.sampler.draws_groups:
            kind = s.sampler.kind
            return f"sources[{i}] ({s.name}).sampler: kind {kind} draws groups, not joint steps"
    for i, s in enumerate(recipe.sources):
        for k in ("any_agent", "all_agents"):
            value = getattr(s, k)
            if value is None:
                continue
            try:
                Where(value).key(recipe.params)
            except FilterError as e:
                return f"sources[{i}] ({s.name}).{k}: {e}"
    return None


def joint_schema_problems(
    recipe: JointRecipe, fields: Mapping[str, Any], tags: Mapping[str, str]
) -> list[str]:
    """The joint keys against a namespace's payload ``fields`` and free ``tags`` (``key:
    why`` each)."""
    if recipe.joint is None:
        return []
    problems = [
        f"fields: {f!r} needs the global state: record with RecordParallelSteps(state=True)"
        for f in (STATE_FIELD, "next_state")
        if f in recipe.fields and STATE_FIELD not in fields
    ]
    for i, s in enumerate(recipe.sources):
        for k in ("any_agent", "all_agents"):
            value = getattr(s, k)
            if value is None:
                continue
            try:
                Where(value, tags).key(recipe.params)
            except FilterError as e:
                problems.append(f"sources[{i}] ({s.name}).{k}: {e}")
    return problems
