"""``group``: whole groups of trajectories of one prompt, for GRPO.

A source with ``sampler: {kind: group, group_by: prompt_uid, group_size: n}`` has the usual
candidates (alive, trainable, matching its ``where``: a filter such as
``policy_version >= $min_version`` applies to each step). Over them, vectorized:

- a *trajectory* is the candidates of one episode (the LLM preset's ``trajectory_uid``),
  ordered by ``step_index``; its key is its first step's ``group_by`` value (steps without
  one are ignored), its *return* its ``tags.final_reward`` where set (the outcome posted
  with ``attach_rewards``), else the sum of its steps' rewards. It has *ended* when one of
  its steps is terminated (``is_last``); rewards are written before that flag, so an ended
  trajectory has its final reward;
- the trajectories of one key, in order of their first step id, form groups of n (the first
  n, the next n, ...: a prompt reused later makes further groups); a group is *complete*
  when it has n trajectories and all have ended;
- ``max_wait_s`` (clock: the group's first step's commit time): with ``partial: drop`` a
  group not complete within it is never drawn; with ``partial: use`` a group still
  incomplete after it is drawn with the trajectories that have ended (at least one).

A draw takes the source's count of distinct ready groups, the oldest first (by their first
step's commit time; ``order: oldest``, the default with ``once``) or uniformly at random
(``order: uniform``, the default without); its rows are the groups' trajectories in
order, each one's steps in order. With ``once: true`` each
group is delivered once per *pass*: the draw skips the groups claimed in the current pass
(:class:`Claims`, read from Redis), and when fewer are left than a batch needs, the next
pass starts (claims cleared), the groups left unclaimed first; with ``passes: p`` no pass
after the p-th starts: the draw waits for new groups instead (``passes: 1`` is on-policy
GRPO: each rollout trained on once). Claims of groups no longer among the candidates
(evicted, or filtered out by the ``where``) are pruned when they outnumber the groups
present (the last pass of a ``passes`` recipe never clears them). The claim itself is made
after the batch is read, all or nothing, by ``lua/claim.lua``, so workers that race never
deliver a group twice in one pass; each claim is marked with the batch's token, and a
batch dropped unserved (a recipe change, a stale pop, a fill taken back) gives back exactly
its own claims (``lua/unclaim.lua``), so no group is lost to a recipe change.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar, Literal, NamedTuple, Self

import numpy as np
from pydantic import PositiveFloat, PositiveInt, StrictBool, StrictStr, model_validator

from claw_tasks.format.schema import tag_column, tag_key
from claw_tasks.format.stepmeta import TERMINATED
from claw_tasks.where import FIXED, FilterError, Where, lookup
from orchestrator.recipe.model import SamplerSpec, Source
from orchestrator.sampling.candidates import Columns, InsufficientData
from orchestrator.sampling.groups import Groups
from orchestrator.sampling.samplers.base import Context, Part, Sampler, register

FINAL = tag_column("final_reward")
"""The column of the LLM preset's final (outcome) reward: a trajectory's return where set."""


def group_key(name: str) -> str:
    """The where key a ``group_by`` names: a fixed key, or a free tag with or without its
    ``tags.`` prefix (``prompt_uid`` is ``tags.prompt_uid``)."""
    if name in FIXED or name.startswith("tags."):
        return name
    return tag_key(name)


class GroupSpec(SamplerSpec):
    """``sampler: {kind: group, group_size, ...}`` (``group_size`` required)."""

    kind: Literal["group"] = "group"
    draws_groups: ClassVar[bool] = True
    group_by: StrictStr = "prompt_uid"
    group_size: PositiveInt | None = None
    max_wait_s: PositiveFloat | None = None
    partial: Literal["drop", "use"] = "drop"
    once: StrictBool = False
    passes: PositiveInt | None = None
    order: Literal["oldest", "uniform"] | None = None
    """Which ready groups a draw takes: ``oldest`` (by first commit) or ``uniform``; the
    default is ``oldest`` with ``once`` (a group waits for no newer one, so none goes stale
    waiting: AReaL's and tinker's rule) and ``uniform`` without (oldest-first would draw
    the same groups every batch)."""

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if self.group_size is None:
            raise ValueError("group_size: required for kind: group")
        if self.order is None:
            self.order = "oldest" if self.once else "uniform"
        self.group_by = group_key(self.group_by)
        if self.passes is not None and not self.once:
            raise ValueError("passes: only with once: true")
        return self

    def problems(self, tags: Mapping[str, str]) -> list[str]:
        try:
            kind = lookup(self.group_by, tags).kind
        except FilterError as e:
            kind, why = None, str(e)
        else:
            why = f"{self.group_by} is a flag; group by a number, a string or episode_id"
        return [] if kind in ("num", "code", "episode") else [f"group_by: {why}"]


class _Table(NamedTuple):
    rows: np.ndarray  # candidate rows with a key, by trajectory then step_index
    t_start: np.ndarray  # per trajectory (by key, first id): its first position in rows
    t_len: np.ndarray
    ended: np.ndarray  # per trajectory: bool
    ret: np.ndarray  # per trajectory: float64 return
    g_start: np.ndarray  # per group: its first trajectory
    g_size: np.ndarray
    g_ended: np.ndarray
    g_t0: np.ndarray  # first commit time
    g_done: np.ndarray  # last terminated step's commit time (-inf: none)
    g_key: np.ndarray
    g_chunk: np.ndarray


@register
class GroupSampler(Sampler):
    """Whole groups: its candidates, and the group table built from them. Whole
    trajectories are drawn as they are: :attr:`Context.accept` does not apply."""

    Spec = GroupSpec

    def __init__(self, source: Source, where: Where, tags: Mapping[str, str]) -> None:
        super().__init__(source, where, tags)
        spec = source.sampler
        assert isinstance(spec, GroupSpec)
        self.size, self.group = int(spec.group_size or 1), spec
        self.key = lookup(spec.group_by, tags)
        self._table: tuple[int, _Table] | None = None

    def dropped(self) -> None:
        self._table = None

    def draw(self, columns: Columns, k: int, ctx: Context) -> Part:
        """``k`` ready groups: their rows and structure. Any change of a candidate (a
        reward, a terminated flag) can complete a group: the table follows the version."""
        self.candidates(columns, ctx.params)
        t = self._groups(columns)
        ready = np.flatnonzero(self._ready(t, ctx.now))
        name, rng, claims = self.source.name, ctx.rng, ctx.claims
        if len(ready) < k:
            raise InsufficientData(name, len(ready), k, "complete groups")
        ids = [self._id(t, g) for g in ready.tolist()]
        pass_no, stale = 0, ()
        oldest = self.group.order == "oldest"

        def order(pos: np.ndarray) -> np.ndarray:  # by first commit (ties: table order)
            return (
                pos[np.argsort(t.g_t0[ready[pos]], kind="stable")]
                if oldest
                else rng.permutation(pos)
            )

        if claims is None and not oldest:
            pick = rng.choice(len(ready), size=k, replace=False)
        elif claims is None:
            pick = order(np.arange(len(ready)))[:k]
        else:
            fresh = np.array([i not in claims.claimed for i in ids], dtype=bool)
            pass_no = claims.pass_no
            left, done = np.flatnonzero(fresh), np.flatnonzero(~fresh)
            passes = self.group.passes
            if len(left) >= k:
                pick = order(left)[:k]
            elif passes is not None and pass_no + 1 >= passes:
                raise InsufficientData(
                    name, len(left), k, f"complete groups not delivered yet (passes: {passes})"
                )
            else:  # the pass is used up: the next starts with the groups left over
                pass_no += 1
                pick = np.concatenate([order(left), order(done)])[:k]
            if len(claims.claimed) > 2 * len(t.g_start) + 1024:
                stale = tuple(claims.claimed - {self._id(t, g) for g in range(len(t.g_start))})
        rows, groups = self._rows(columns, t, ready[pick], [ids[i] for i in pick.tolist()], pass_no)
        weights = np.ones(len(rows), np.float32)
        return Part(rows, weights, groups._replace(stale=stale))

    def _id(self, t: _Table, g: int) -> str:
        """A group's id, what ``once`` claims record: source, key, chunk."""
        return f"{self.source.name}|{float(t.g_key[g])!r}|{int(t.g_chunk[g])}"

    def _ready(self, t: _Table, now: float) -> np.ndarray:
        n, spec = self.size, self.group
        complete = (t.g_size == n) & (t.g_ended == n)
        if spec.max_wait_s is None:
            return complete
        if spec.partial == "drop":
            return complete & (t.g_done - t.g_t0 <= spec.max_wait_s)
        return complete | ((now - t.g_t0 > spec.max_wait_s) & (t.g_ended > 0))

    def _rows(
        self, columns: Columns, t: _Table, picked: np.ndarray, ids: list[str], pass_no: int
    ) -> tuple[np.ndarray, Groups]:
        parts, group, traj, ret = [], [], [], []
        j = 0
        for g_no, g in enumerate(picked.tolist()):
            for tr in range(t.g_start[g], t.g_start[g] + t.g_size[g]):
                if not t.ended[tr]:
                    continue
                part = t.rows[t.t_start[tr] : t.t_start[tr] + t.t_len[tr]]
                parts.append(part)
                group.append(np.full(len(part), g_no, np.int32))
                traj.append(np.full(len(part), j, np.int32))
                ret.append(np.full(len(part), t.ret[tr], np.float32))
                j += 1
        rows = np.concatenate(parts)
        cat = np.concatenate
        return rows, Groups(cat(group), cat(traj), cat(ret), tuple(ids), pass_no)

    def _groups(self, columns: Columns) -> _Table:
        """The group table of the current candidates, cached per version."""
        if self._table is not None and self._table[0] == self.version:
            return self._table[1]
        rows = np.flatnonzero(self.cand)
        kv = columns[self.key.column][rows]
        has = ~np.isnan(kv) if kv.dtype.kind == "f" else kv != 0
        rows, kv = rows[has], kv[has].astype(np.float64)
        ep = columns["episode"][rows]
        order = np.lexsort((columns["step_index"][rows], ep))
        rows, kv, ep = rows[order], kv[order], ep[order]
        starts = _runs(ep)
        if not len(rows):
            empty = np.zeros(0, np.int64)
            table = _Table(rows, *([empty] * 4), *([empty] * 7))
            self._table = (self.version, table)
            return table
        term = (columns["flags"][rows] & TERMINATED) != 0
        ts = columns["timestamp"][rows]
        lens = np.diff(np.r_[starts, len(rows)])
        first = np.minimum.reduceat(columns["id"][rows], starts)
        ended = np.maximum.reduceat(term.astype(np.int8), starts).astype(bool)
        ret = np.add.reduceat(columns["reward"][rows].astype(np.float64), starts)
        if FINAL in columns:  # the outcome the gateway posted, where it did
            final = np.fmax.reduceat(columns[FINAL][rows], starts)
            ret = np.where(np.isnan(final), ret, final)
        t0 = np.minimum.reduceat(ts, starts)
        done = np.maximum.reduceat(np.where(term, ts, -np.inf), starts)
        key = kv[starts]
        by = np.lexsort((first, key))  # trajectories by key, then first step id
        key = key[by]
        k_start = _runs(key)
        run = np.cumsum(np.r_[True, key[1:] != key[:-1]]) - 1
        chunk = (np.arange(len(by)) - k_start[run]) // self.size
        g_start = np.flatnonzero(np.r_[True, (key[1:] != key[:-1]) | (chunk[1:] != chunk[:-1])])
        table = _Table(
            rows,
            starts[by],
            lens[by],
            ended[by],
            ret[by],
            g_start,
            np.diff(np.r_[g_start, len(by)]),
            np.add.reduceat(ended[by].astype(np.int64), g_start),
            np.minimum.reduceat(t0[by], g_start),
            np.maximum.reduceat(done[by], g_start),
            key[g_start],
            chunk[g_start],
        )
        self._table = (self.version, table)
        return table


def _runs(values: np.ndarray) -> np.ndarray:
    """Start positions of the runs of equal values."""
    if not len(values):
        return np.zeros(0, np.int64)
    return np.flatnonzero(np.r_[True, values[1:] != values[:-1]])
