"""A recipe's batch of global rows, drawn from its sources' samplers.

Every batch holds exactly ``recipe.counts[i]`` rows of source ``i`` (group sources:
``counts[i]`` groups), in source order. The samplers keep their state current from the
changed rows: :meth:`RecipeSampler.refresh` costs O(changed · log N) for the samplers
with sum trees.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from claw_tasks.format.stepmeta import TERMINATED
from claw_tasks.where import Encoder, Where
from orchestrator.recipe.model import Recipe, Source
from orchestrator.sampling.candidates import Columns, sorted_unique, unique
from orchestrator.sampling.groups import Claims, Groups
from orchestrator.sampling.joint import JointTable, JointWhere, joint_acceptor
from orchestrator.sampling.samplers.base import SAMPLERS, Accept, Context, Part
from orchestrator.sampling.sequences import has_next_obs, n_step, windows
from orchestrator.sampling.stacks import Predecessors
from orchestrator.sampling.sumtree import MaxTree
from orchestrator.sampling.transitions import Transitions


class Draw(NamedTuple):
    """A batch's rows, in source order."""

    rows: np.ndarray  # int64 global rows
    weights: np.ndarray  # float32 importance weights (1 but for priority sources)
    source: np.ndarray  # int16 index into recipe.sources
    groups: Groups | None = None  # group sources: which group and trajectory each row is


class RecipeSampler:
    """Draws a recipe's batches from the columns of one namespace.

    ``encode`` maps strings to dictionary codes, ``tags`` is the schema's free tags
    (name -> 'str' | 'num'), ``cap`` the slots per shard. Call :meth:`refresh` with the rows
    whose metadata changed since the last call (or None when unknown) before sampling.
    """

    def __init__(self, recipe: Recipe, encode: Encoder, tags: Mapping[str, str], cap: int):
        self.recipe, self.cap = recipe, cap
        agents = recipe.joint.agents if recipe.joint is not None else None
        self.joint = JointTable(agents, encode, cap) if agents is not None else None
        """Joint recipes: the joint steps; the sources draw their anchors."""
        self.transitions: list[Transitions | None] = [
            None
            if s.transition is None
            else Transitions(
                s.transition.from_skill, s.transition.to_skill, s.transition.window, encode, cap
            )
            for s in recipe.sources
        ]
        """Per source: the members of its ``transition`` windows, if it has one."""
        self.sources = [
            SAMPLERS[s.sampler.kind](s, self._where(s, tags, encode, t), tags)
            for s, t in zip(recipe.sources, self.transitions, strict=True)
        ]
        self.counts = recipe.counts
        self.stacks = Predecessors(cap) if recipe.frame_stack > 1 else None
        """Each row's predecessor, for ``frame_stack`` recipes (the batch's stacks too)."""
        if self.joint is not None:
            self._accept = joint_acceptor(self.joint, recipe.fields, cap)
        else:
            self._accept = _acceptor(recipe, cap, self.stacks)
        self._needs_max = any(s.needs_max_priority for s in self.sources)
        self._max: MaxTree | None = None

    def _where(
        self, s: Source, tags: Mapping[str, str], encode: Encoder, t: Transitions | None
    ) -> Any:
        where = Where(bounded(self.recipe, s.where, tags), tags, encode)
        if t is not None:
            return TransitionWhere(where, t)
        if self.joint is None:
            return where
        agent = [None if w is None else Where(w, tags, encode) for w in (s.any_agent, s.all_agents)]
        return JointWhere(self.joint, where, *agent)

    def refresh(self, columns: Columns, rows: np.ndarray | None = None) -> None:
        """Account for changed ``rows``; None rebuilds everything on the next draw."""
        if self.stacks is not None:
            self.stacks.refresh(rows)
        if self.joint is not None:
            self.joint.refresh(rows)
        if rows is None:
            self._max = None
            for s, t in zip(self.sources, self.transitions, strict=True):
                s.invalidate()
                if t is not None:
                    t.invalidate()
            return
        rows = sorted_unique(rows)
        if self._max is not None:
            self._max.update(rows, _max_leaves(columns, rows))
        for s, t in zip(self.sources, self.transitions, strict=True):
            if t is not None and t.members is not None:  # and the rows near those
                s.refresh(columns, unique(np.concatenate([rows, t.update(columns, rows)])))
            else:
                s.refresh(columns, rows)

    def max_priority(self, columns: Columns) -> float:
        """Largest priority set on a live step (1.0 when none is): what unset steps count as."""
        if self._max is None:
            self._max = MaxTree(_max_leaves(columns, None), np.float32)
        m = self._max.max
        return m if m > -np.inf else 1.0

    def sample(
        self,
        columns: Columns,
        rng: np.random.Generator,
        params: Mapping[str, Any] | None = None,
        now: float | None = None,
        claims: Claims | None = None,
    ) -> Draw:
        """One batch. ``params`` override the recipe's; ``now`` defaults to the clock;
        ``claims``: the groups a ``once`` recipe delivered in its current pass."""
        live = {**self.recipe.params, **(params or {})}
        now = time.time() if now is None else now
        max_p = self.max_priority(columns) if self._needs_max else 1.0
        ctx = Context(live, rng, now, max_p, self._accept, claims)
        parts = [s.draw(columns, k, ctx) for s, k in zip(self.sources, self.counts, strict=True)]
        cat = np.concatenate
        source = [np.full(len(p.rows), i, dtype=np.int16) for i, p in enumerate(parts)]
        groups = _numbered(parts) if self.recipe.grouped else None
        return Draw(
            cat([p.rows for p in parts]), cat([p.weights for p in parts]), cat(source), groups
        )


class TransitionWhere:
    """A ``transition`` source's filter, as the samplers see it (``key`` and ``mask``, as
    :class:`~claw_tasks.where.Where`): its ``where`` and membership in the A→B windows.
    The key changes when a skill's code appears (nothing was a member before)."""

    def __init__(self, where: Where, transitions: Transitions) -> None:
        self.where, self.transitions = where, transitions

    @property
    def columns(self) -> frozenset[str]:
        return self.where.columns | {"skill_tag", "next", "id", "alive"}

    def key(self, params: Mapping[str, Any] | None = None) -> tuple[Any, ...]:
        return (self.transitions.current_codes(), *self.where.key(params))

    def mask(
        self,
        columns: Columns,
        params: Mapping[str, Any] | None = None,
        rows: np.ndarray | None = None,
        now: float | None = None,
    ) -> np.ndarray:
        members = self.transitions.mask(columns)
        return self.where.mask(columns, params, rows, now) & (
            members if rows is None else members[rows]
        )


def bounded(recipe: Recipe, where: Any, tags: Mapping[str, str]) -> Any:
    """``where`` within an ``admission`` recipe's staleness bound: and'ed with
    ``tags.min_version >= $min_version`` (a trajectory's oldest turn, where the namespace
    has that tag, as the capture gateway's namespaces do; a multi-turn trajectory is then
    served whole or not at all), else ``policy_version >= $min_version``; the recipe keeps
    ``min_version`` at v - max_staleness. The declaration alone bounds what is served, with
    or without a ``where`` of the source's own."""
    adm = recipe.admission
    if adm is None:
        return where
    key = "tags.min_version" if tags.get("min_version") == "num" else "policy_version"
    bound = {key: {"ge": f"${adm.min_version_param}"}}
    own = Where(where, tags).mapping()
    return {"and": [own, bound]} if own else bound


def _numbered(parts: list[Part]) -> Groups:
    """The sources' groups as one batch's: groups and trajectories numbered across them."""
    group, traj, ret, ids, stale = [], [], [], [], []
    pass_no = 0
    for p in parts:
        g = p.groups
        assert g is not None
        group.append(g.group + len(ids))
        traj.append(g.trajectory + (int(traj[-1][-1]) + 1 if traj else 0))
        ret.append(g.returns)
        ids += g.ids
        stale += g.stale
        pass_no = max(pass_no, g.pass_no)
    cat = np.concatenate
    return Groups(cat(group), cat(traj), cat(ret), tuple(ids), pass_no, tuple(stale))


def _max_leaves(columns: Columns, rows: np.ndarray | None) -> np.ndarray:
    p, alive = columns["priority"], columns["alive"]
    if rows is not None:
        p, alive = p[rows], alive[rows]
    return np.where(alive & ~np.isnan(p), p, -np.inf).astype(np.float32)


def _acceptor(recipe: Recipe, cap: int, stacks: Predecessors | None) -> Accept | None:
    """The completeness check a recipe's rows must pass, if any."""
    transitions = "next_obs" in recipe.fields or recipe.n_step > 1
    length, n, k = recipe.sequence_length, recipe.n_step, recipe.frame_stack
    if length == 1 and not transitions and stacks is None:
        return None

    def accept(columns: Columns, rows: np.ndarray) -> np.ndarray:
        if length == 1:
            if transitions and n == 1:  # n_step's ``ready`` of one step, without its sums
                ok = ((columns["flags"][rows] & TERMINATED) != 0) | has_next_obs(columns, rows, cap)
            else:
                ok = np.ones(len(rows), bool)
                if transitions:
                    ok &= n_step(columns, rows, n, 1.0, cap).ready
            if stacks is not None:
                ok &= stacks.complete(columns, rows, k)
            return ok
        win = windows(columns, rows, length, cap)
        ok = win[:, -1] >= 0
        if transitions:
            flat = np.where(ok[:, None], win, rows[:, None]).ravel()
            ok &= n_step(columns, flat, n, 1.0, cap).ready.reshape(-1, length).all(axis=1)
        return ok

    return accept
