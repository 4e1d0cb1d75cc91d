"""Joint steps in the sampling index: which records form each one, which are complete, and
the filters of joint recipes.

The records of one joint step share ``(tags.joint_episode, step_index)`` and one of them,
the anchor, has ``tags.joint_agents`` (:mod:`claw_tasks.format.joint`). A joint recipe's
samplers draw anchors: a joint row *is* its anchor's global row, so the samplers of single
rows (uniform, priority, recent, their windows and mixtures) draw joint rows unchanged,
``window: {last_steps: n}`` keeps the n newest joint steps among the candidates, and a
joint row's priority is its anchor's (``update_priorities(batch.ids, ...)`` sets it; the
other agents' records keep their own, for per-agent views).

An anchor is a candidate only while its joint step is *complete*: every record it counted
(``joint_agents``) is alive, each of a different agent, and it is the step's one anchor. A
record evicted (retention, the ring, by hand), two records naming one agent, or two
anchors make a joint step *partial*, and a partial joint step is never served (not
masked): a joint row's agents are all that were there. :attr:`JointTable.partial` counts
them (``batch.meta["joint"]``).
The fetch checks every member record along with the anchor, so one evicted between the
draw and the read makes the batch be drawn again.

:class:`JointTable` is rebuilt from the columns when they changed (O(records log records),
like the group table of :mod:`orchestrator.sampling.samplers.group`), then each source's
candidates follow.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from claw_tasks.format.joint import AGENTS_TAG, EPISODE_TAG
from claw_tasks.format.schema import tag_column
from claw_tasks.format.stepmeta import TERMINATED, TRUNCATED, UNTRAINABLE
from claw_tasks.where import Encoder, Where
from orchestrator.sampling.candidates import Columns
from orchestrator.sampling.sequences import has_next_obs

EPISODE_COLUMN = tag_column(EPISODE_TAG)
AGENTS_COLUMN = tag_column(AGENTS_TAG)
_END = TERMINATED | TRUNCATED


class _Table(NamedTuple):
    rows: np.ndarray  # live joint records, by joint key (episode, step_index)
    start: np.ndarray  # per joint step: its first position in rows
    anchor: np.ndarray  # per joint step: its anchor's global row (-1: none stored)
    complete: np.ndarray  # per joint step: the anchor and every record it counted are alive
    drawable: np.ndarray  # complete, and every record trainable
    ended: np.ndarray  # per joint step: every record terminated or truncated (its last)
    next: np.ndarray  # per joint step: the next one of its episode (-1: not stored)
    members: np.ndarray  # (steps, agents): the recipe's agents' records, -1 where absent
    of_anchor: np.ndarray  # int32 per global row: the joint step a drawable anchor is (-1)


class JointTable:
    """The joint steps of a namespace's columns, for one recipe's ``agents`` (their
    order is the batch's; None: no members, e.g. for queries); rebuilt when
    :meth:`refresh` saw changes. ``trainable``: an anchor is drawable only while every
    record of its joint step is trainable (sampling); False: while complete (queries)."""

    def __init__(
        self,
        agents: Sequence[str] | None,
        encode: Encoder | None,
        cap: int,
        trainable: bool = True,
    ) -> None:
        self.agents, self.encode, self.cap = list(agents or ()), encode, cap
        self.trainable = trainable
        self.version = 0
        self._table: tuple[int, _Table] | None = None
        self._reduced: dict[tuple[Any, ...], np.ndarray] = {}

    def refresh(self, rows: np.ndarray | None) -> None:
        """The columns changed at ``rows`` (None: everything): rebuild on next use."""
        if rows is None or len(rows):
            self.version += 1
            self._reduced.clear()

    def table(self, columns: Columns) -> _Table:
        """The joint steps of the current columns (cached per version)."""
        if self._table is None or self._table[0] != self.version:
            self._table = (self.version, self._build(columns))
        return self._table[1]

    @property
    def counts(self) -> dict[str, int]:
        """Joint steps stored complete and partial (some record gone), as last built."""
        if self._table is None:
            return {"complete": 0, "partial": 0}
        t = self._table[1]
        complete = int(t.complete.sum())
        return {"complete": complete, "partial": len(t.start) - complete}

    def members(self, columns: Columns, anchors: np.ndarray) -> np.ndarray:
        """``(len(anchors), agents)`` global rows of the agents' records (-1: absent)."""
        t = self.table(columns)
        return t.members[t.of_anchor[anchors]]

    def anchors_ok(self, columns: Columns, rows: np.ndarray | None = None) -> np.ndarray:
        """Whether each row (every global row when None) is a drawable anchor."""
        of = self.table(columns).of_anchor
        return (of if rows is None else of[rows]) >= 0

    def per_step(
        self, columns: Columns, where: Where, params: Mapping[str, Any], how: str
    ) -> np.ndarray:
        """Per joint step: whether ``any`` / ``all`` of its records match ``where``."""
        t = self.table(columns)
        key = (how, id(where), where.key(params))
        got = self._reduced.get(key)
        if got is None:
            if not len(t.rows):
                got = np.zeros(0, bool)
            else:
                hit = where.mask(columns, params, t.rows)
                reduce = np.logical_or if how == "any" else np.logical_and
                got = reduce.reduceat(hit, t.start)
            self._reduced[key] = got
        return got

    def records(self, columns: Columns, anchors: np.ndarray) -> np.ndarray:
        """Every stored record of the anchors' joint steps, sorted."""
        t = self.table(columns)
        g = t.of_anchor[anchors]
        g = g[g >= 0]
        if not len(g):
            return np.zeros(0, np.int64)
        stop = np.r_[t.start, len(t.rows)]
        lengths = stop[g + 1] - stop[g]
        first = np.repeat(stop[g], lengths)
        offset = np.arange(lengths.sum()) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        return np.sort(t.rows[first + offset])

    def next_anchor(self, columns: Columns, anchors: np.ndarray) -> np.ndarray:
        """The anchor of each anchor's next joint step (-1: none stored)."""
        t = self.table(columns)
        nxt = t.next[t.of_anchor[anchors]]
        return np.where(nxt >= 0, t.anchor[np.maximum(nxt, 0)], -1)

    def ended(self, columns: Columns, anchors: np.ndarray) -> np.ndarray:
        """Whether each anchor's joint step is its episode's last for every agent in it."""
        t = self.table(columns)
        return t.ended[t.of_anchor[anchors]]

    def _build(self, columns: Columns) -> _Table:
        n_rows = len(columns["id"])
        of_anchor = np.full(n_rows, -1, np.int32)
        if EPISODE_COLUMN not in columns or AGENTS_COLUMN not in columns:
            e, no = np.zeros(0, np.int64), np.zeros(0, bool)
            members = np.zeros((0, len(self.agents)), np.int64)
            return _Table(e, e, e, no, no, no, e, members, of_anchor)
        ep = columns[EPISODE_COLUMN]
        rows = np.flatnonzero(columns["alive"] & ~np.isnan(ep))
        e, t = ep[rows], columns["step_index"][rows]
        order = np.lexsort((t, e))
        rows, e, t = rows[order], e[order], t[order]
        new = np.r_[True, (e[1:] != e[:-1]) | (t[1:] != t[:-1])] if len(rows) else np.zeros(0, bool)
        start = np.flatnonzero(new)
        g = np.cumsum(new) - 1  # each record's joint step
        n_steps = len(start)
        count = np.diff(np.r_[start, len(rows)])
        need = columns[AGENTS_COLUMN][rows]
        is_anchor = ~np.isnan(need)
        anchor = np.full(n_steps, -1, np.int64)
        anchor[g[is_anchor][::-1]] = rows[is_anchor][::-1]  # the first, should there be two
        counted = np.full(n_steps, np.nan)
        counted[g[is_anchor]] = need[is_anchor]
        one_anchor = np.bincount(g[is_anchor], minlength=n_steps) == 1
        complete = one_anchor & (count == counted) & ~_repeats_agent(columns, rows, g, n_steps)
        flags = columns["flags"][rows]
        trainable = (
            np.logical_and.reduceat((flags & UNTRAINABLE) == 0, start) if n_steps else complete
        )
        drawable = complete & trainable if self.trainable else complete.copy()
        ended = np.logical_and.reduceat((flags & _END) != 0, start) if n_steps else complete
        ge, gt = e[start], t[start]
        nxt = np.full(n_steps, -1, np.int64)
        follows = (ge[1:] == ge[:-1]) & (gt[1:] == gt[:-1] + 1)
        nxt[:-1][follows] = np.arange(1, n_steps)[follows]
        members = np.full((n_steps, len(self.agents)), -1, np.int64)
        if self.agents and self.encode is not None:
            agent_col = columns["agent_id"][rows]
            for j, code in enumerate(self.encode("agent_id", self.agents).tolist()):
                if code > 0:
                    mine = agent_col == code
                    members[g[mine], j] = rows[mine]
        if self.agents:  # a row needs one of the recipe's agents
            drawable &= (members >= 0).any(axis=1)
        of_anchor[anchor[drawable]] = np.flatnonzero(drawable)
        return _Table(rows, start, anchor, complete, drawable, ended, nxt, members, of_anchor)


def _repeats_agent(columns: Columns, rows: np.ndarray, g: np.ndarray, n_steps: int) -> np.ndarray:
    """Per joint step: whether two of its records name the same agent. Such a step counts
    ``joint_agents`` records without having that many agents (a row holds one record per
    agent: the other would be dropped), so it is partial: never served, counted."""
    agent = columns.get("agent_id")
    out = np.zeros(n_steps, bool)
    if agent is None or not len(rows):
        return out
    code = agent[rows]
    named = code > 0  # a record without an agent id repeats none
    gs, cs = g[named], code[named]
    order = np.lexsort((cs, gs))
    gs, cs = gs[order], cs[order]
    same = (gs[1:] == gs[:-1]) & (cs[1:] == cs[:-1])
    out[gs[1:][same]] = True
    return out


class JointWhere:
    """A joint source's filter, as the samplers see it (``key`` and ``mask``, as
    :class:`~claw_tasks.where.Where`): its ``where`` on the anchor, the anchor's joint step
    drawable, and ``any_agent`` / ``all_agents`` over the joint step's records."""

    def __init__(
        self,
        table: JointTable,
        where: Where,
        any_agent: Where | None = None,
        all_agents: Where | None = None,
    ) -> None:
        self.table, self.where = table, where
        self.any_agent, self.all_agents = any_agent, all_agents

    @property
    def columns(self) -> frozenset[str]:
        parts = [w.columns for w in (self.where, self.any_agent, self.all_agents) if w]
        return frozenset().union(*parts)

    def key(self, params: Mapping[str, Any] | None = None) -> tuple[Any, ...]:
        """Changes with the params and with every rebuild of the joint table."""
        parts = [
            w.key(params) if w else None for w in (self.where, self.any_agent, self.all_agents)
        ]
        return (self.table.version, *parts)

    def mask(
        self,
        columns: Columns,
        params: Mapping[str, Any] | None = None,
        rows: np.ndarray | None = None,
        now: float | None = None,
    ) -> np.ndarray:
        params = params or {}
        ok = self.where.mask(columns, params, rows, now) & self.table.anchors_ok(columns, rows)
        for w, how in ((self.any_agent, "any"), (self.all_agents, "all")):
            if w is None:
                continue
            of = self.table.table(columns).of_anchor
            of = of if rows is None else of[rows]
            step = self.table.per_step(columns, w, params, how)
            ok &= np.where(of >= 0, step[np.maximum(of, 0)] if len(step) else False, False)
        return ok


def joint_acceptor(
    table: JointTable, fields: Sequence[str], cap: int
) -> Callable[[Columns, np.ndarray], np.ndarray] | None:
    """The completeness a joint recipe's rows need: with ``next_obs``, every present agent's
    next observation stored (or its step terminated); with ``next_state``, the next joint
    step's anchor stored or the step is its episode's last."""
    want_obs, want_state = "next_obs" in fields, "next_state" in fields
    if not (want_obs or want_state):
        return None

    def accept(columns: Columns, anchors: np.ndarray) -> np.ndarray:
        ok = table.anchors_ok(columns, anchors)
        if not ok.any():
            return ok
        anchors = np.where(ok, anchors, anchors[ok][0])  # the others' answers are ignored
        if want_obs:
            m = table.members(columns, anchors)
            flat = m[m >= 0]
            ready = has_next_obs(columns, flat, cap) | ((columns["flags"][flat] & TERMINATED) != 0)
            full = np.ones(m.shape, bool)
            full[m >= 0] = ready
            ok &= full.all(axis=1)
        if want_state:
            ok &= (table.next_anchor(columns, anchors) >= 0) | table.ended(columns, anchors)
        return ok

    return accept
