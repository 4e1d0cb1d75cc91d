"""Assembling a joint batch: the drawn anchors' joint steps, one row each.

Every present agent's record is read like a row of a plain recipe (one
:class:`~orchestrator.sampling.assembly.Assembly`, one fetch, which also reads the anchors'
``state`` and checks every record read), then laid out per agent in the recipe's order:

- each per-agent field ``(B, n_agents, ...)`` (strings nested ``[B][n_agents]`` in
  ``meta``), zeros (None) where the agent is absent; ``mask`` bool ``(B, n_agents)``;
- ``state`` ``(B, *state_shape)``, the anchor's; ``next_state`` the next joint step's, or
  the state after the episode's last step (zeros where the recorder had none);
- ``team_reward`` float32 ``(B,)``: the sum of the present agents' rewards;
- ``step_ids`` int64 ``(B, n_agents)``: each agent's record (-1 absent);
- ``ids``: the anchors' step ids (a joint row's priority is its anchor's);
- ``meta["joint"]``: the complete and partial joint steps stored when it was drawn.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from claw_tasks.format.joint import STATE_FIELD
from orchestrator.recipe.joint import JOINT_FIELDS
from orchestrator.recipe.model import Recipe
from orchestrator.sampling.assembly import Assembly, Reader
from orchestrator.sampling.batch import Batch
from orchestrator.sampling.joint import JointTable
from orchestrator.sampling.samplers import Draw

_STATE, _NEXT = "~state", "~next_state"


def assemble_joint(
    session: Reader,
    recipe: Recipe,
    draw: Draw,
    table: JointTable,
    columns: Mapping[str, np.ndarray] | None = None,
) -> Batch | None:
    """The joint batch of ``draw`` (its rows are anchors), or None when a record was gone
    by the time it was read (the caller draws again). ``columns``: as :class:`Assembly`
    takes them."""
    cols = session.index.columns if columns is None else columns
    anchors = draw.rows
    members = table.members(cols, anchors)
    present = members >= 0
    flat = members[present]  # by row, then agent
    per_agent = [f for f in recipe.fields if f not in JOINT_FIELDS]
    if "team_reward" in recipe.fields and "reward" not in per_agent:
        per_agent.append("reward")
    extra: dict[str, tuple[str, np.ndarray]] = {}
    want_next = "next_state" in recipe.fields
    nxt = table.next_anchor(cols, anchors) if want_next else np.zeros(0, np.int64)
    if STATE_FIELD in recipe.fields or want_next:
        extra[_STATE] = (STATE_FIELD, anchors)
    if want_next:
        extra[_NEXT] = (STATE_FIELD, nxt[nxt >= 0])
    flat_recipe = recipe.model_copy(update={"fields": per_agent or ["reward"], "joint": None})
    flat_draw = Draw(flat, np.ones(len(flat), np.float32), np.zeros(len(flat), np.int16))
    got = Assembly(session, flat_recipe, flat_draw, extra=extra, columns=cols).run()
    if got is None:
        return None
    fields: dict[str, Any] = {}
    meta: dict[str, Any] = {}
    values = {**got.fields, **got.meta}
    for name in per_agent:
        if name in got.fields and name in recipe.fields:
            fields[name] = _per_agent(got.fields[name], present)
        elif name in got.meta and name in recipe.fields:
            meta[name] = _per_agent(got.meta[name], present)
    fields["mask"] = present
    if STATE_FIELD in recipe.fields or want_next:
        states = values[_STATE]
        shape = session.index.schema.fields[STATE_FIELD].shape[1:]  # type: ignore[union-attr]  # a joint namespace has a schema
        dtype = np.dtype(session.index.schema.fields[STATE_FIELD].dtype)  # type: ignore[union-attr]  # a joint namespace has a schema
        if STATE_FIELD in recipe.fields:
            fields[STATE_FIELD] = _items(states, 0, shape, dtype)
        if want_next:
            after = _items(states, 1, shape, dtype)  # the state after an episode's last step
            linked = nxt >= 0
            after[linked] = _items(values[_NEXT], 0, shape, dtype)
            fields["next_state"] = after
    if "team_reward" in recipe.fields:
        reward = _per_agent(got.fields["reward"], present)
        fields["team_reward"] = reward.sum(axis=1, dtype=np.float32)
    if "step_ids" in recipe.fields:
        fields["step_ids"] = np.where(present, cols["id"][np.maximum(members, 0)], -1)
    ordered = {k: fields[k] for k in [*recipe.fields, "mask"] if k in fields}
    meta["joint"] = table.counts
    return Batch(
        ordered,
        ids=cols["id"][anchors],
        weights=draw.weights,
        source_index=draw.source,
        sources=tuple(s.name for s in recipe.sources),
        recipe_version=recipe.version,
        meta=meta,
    )


def _per_agent(value: Any, present: np.ndarray) -> Any:
    """Rows of present agents (in ``present``'s row-major order) laid out ``(B, n, ...)``:
    zeros where absent for arrays; nested lists (None, or an empty array for ragged rows)
    otherwise."""
    b, n = present.shape
    if isinstance(value, np.ndarray) and not value.dtype.hasobject:
        out = np.zeros((b, n, *value.shape[1:]), value.dtype)
        out[present] = value
        return out
    items = value.tolist() if isinstance(value, np.ndarray) else list(value)
    empty: Any = None
    arrays = [x for x in items if isinstance(x, np.ndarray)]
    if arrays:
        empty = arrays[0][:0]
    nested: list[list[Any]] = [[empty] * n for _ in range(b)]
    it = iter(items)
    for i, j in zip(*np.nonzero(present), strict=True):
        nested[int(i)][int(j)] = next(it)
    return nested


def _items(rows: list[np.ndarray], k: int, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """Item ``k`` of each ragged ``state`` row, ``(len(rows), *shape)``; zeros where a row
    has none."""
    out = np.zeros((len(rows), *shape), dtype)
    for i, r in enumerate(rows):
        if len(r) > k:
            out[i] = r[k]
    return out
