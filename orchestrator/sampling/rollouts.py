"""Rollouts: which steps an on-policy recipe takes for a policy version, as chains.

A rollout recipe (``rollout:`` in the recipe; docs/recipes.md, "On-policy") serves each
step at most once. Over the index's columns, :func:`select` sorts the source's candidates
(alive, trainable, matching its ``where``, carrying the ``log_prob`` and ``value`` tags:
on-policy steps) that no rollout took and no sweep counted yet (``classified``, sorted
ids kept in Redis by the delivery side) into:

- *stale*: ``policy_version`` below the window ``[lo, hi]``: never served, counted once;
- *ready* in the window: the value of the state after the step is known (terminated:
  none is needed; ``bootstrap_value`` set; or the episode's next step is stored with its
  ``value``), taken oldest first by ``(policy_version, id)`` once there are ``steps``;
- *waiting* in the window: the rest (a segment's later steps not committed yet);
- above the window: left for a later target.

The taken steps become :class:`Chained` rows: by episode and ``step_index``, a chain
running while the episode's next step is the next row (a segment cut inside an episode,
or steps of the episode this rollout did not take, end a chain: it bootstraps with
``bootstrap_value`` where the actor gave one, else with the next step's ``value``). That
is the layout :mod:`orchestrator.transforms.advantages` computes over.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import numpy as np

from claw_tasks.format.schema import BOOTSTRAP_VALUE, LOG_PROB, VALUE, tag_column
from claw_tasks.format.stepmeta import TERMINATED
from orchestrator.sampling.sequences import follow

Columns = Mapping[str, np.ndarray]


class Chained(NamedTuple):
    """A rollout's steps in chain order (see the module docstring); one entry per step."""

    ids: np.ndarray  # int64
    version: np.ndarray  # int32: policy_version
    reward: np.ndarray  # float64
    value: np.ndarray  # float64: the behaviour critic's V(obs)
    log_prob: np.ndarray  # float64: the behaviour policy's log-prob of the action
    next_value: np.ndarray  # float64: V of the state after the step (read at chain ends)
    terminated: np.ndarray  # bool
    chain_end: np.ndarray  # bool


class Selection(NamedTuple):
    """What :func:`select` found."""

    stale: np.ndarray  # int64 ids below the window, not classified before
    ready: int  # ready candidates in the window
    waiting: int  # candidates in the window whose next value is not known yet
    taken: Chained | None  # the rollout, when ``ready >= steps``
    alive: np.ndarray  # with ``taken``: the classified ids still alive (the rest can go)


def _tag(columns: Columns, name: str, rows: np.ndarray) -> np.ndarray:
    """A rollout tag's values at ``rows``, NaN where unset or not finite as float32 (the
    type the advantages are computed in: such a value, stored by a path that did not
    check it so, counts as missing and its step is never served)."""
    col = columns.get(tag_column(name))
    if col is None:
        return np.full(len(rows), np.nan)
    x = np.asarray(col[rows], np.float64)
    with np.errstate(over="ignore"):
        return np.where(np.isfinite(x.astype(np.float32)), x, np.nan)


def select(
    columns: Columns,
    candidates: np.ndarray,
    cap: int,
    classified: np.ndarray,
    lo: int,
    hi: int,
    steps: int,
) -> Selection:
    """Sort the ``candidates`` (bool per global row) not in ``classified`` (sorted ids) by
    the window ``[lo, hi]`` of policy versions; take ``steps`` ready ones if there are."""
    ids_all = columns["id"]
    rows = np.flatnonzero(candidates)
    rows = rows[~np.isnan(_tag(columns, VALUE, rows)) & ~np.isnan(_tag(columns, LOG_PROB, rows))]
    ids = ids_all[rows]
    if len(classified):
        fresh = ~np.isin(ids, classified)
        rows, ids = rows[fresh], ids[fresh]
    version = columns["policy_version"][rows]
    stale = ids[version < lo]
    win = (version >= lo) & (version <= hi)
    rows, ids, version = rows[win], ids[win], version[win]
    term = (columns["flags"][rows] & TERMINATED) != 0
    boot = _tag(columns, BOOTSTRAP_VALUE, rows)
    succ = follow(columns, rows, cap)
    succ_value = np.where(succ >= 0, _tag(columns, VALUE, np.maximum(succ, 0)), np.nan)
    ready = term | ~np.isnan(boot) | ~np.isnan(succ_value)
    n_ready = int(ready.sum())
    taken, alive = None, classified
    if n_ready >= steps:
        r, i, v = rows[ready], ids[ready], version[ready]
        first = np.lexsort((i, v))[:steps]
        taken = _chained(columns, r[first], cap)
        alive = classified[np.isin(classified, ids_all[columns["alive"]])]
    return Selection(stale, n_ready, int((~ready).sum()), taken, alive)


def _chained(columns: Columns, rows: np.ndarray, cap: int) -> Chained:
    order = np.lexsort((columns["step_index"][rows], columns["episode"][rows]))
    rows = rows[order]
    succ = follow(columns, rows, cap)
    end = np.ones(len(rows), bool)
    end[:-1] = succ[:-1] != rows[1:]
    term = (columns["flags"][rows] & TERMINATED) != 0
    boot = _tag(columns, BOOTSTRAP_VALUE, rows)
    succ_value = np.where(succ >= 0, _tag(columns, VALUE, np.maximum(succ, 0)), np.nan)
    next_value = np.where(term, 0.0, np.where(np.isnan(boot), succ_value, boot))
    return Chained(
        columns["id"][rows].astype(np.int64),
        columns["policy_version"][rows].astype(np.int32),
        columns["reward"][rows].astype(np.float64),
        _tag(columns, VALUE, rows).astype(np.float64),
        _tag(columns, LOG_PROB, rows).astype(np.float64),
        next_value.astype(np.float64),
        term,
        end,
    )
