"""The search page: the steps a where matches, as a page of steps (newest first) or of
episodes (most recent first), with the reward histogram and the commonest groups."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from claw_tasks.format.stepmeta import UNTRAINABLE
from orchestrator.inspect.query import Query
from orchestrator.web import charts
from orchestrator.web.access import Access, step_row

PAGE = 50
GROUP_KEYS = ("task_id", "agent_id", "skill_tag")


@dataclass
class SearchResult:
    expression: str
    since: str
    view: str  # "episodes" or "steps"
    page: int
    live: int
    matched: int
    pages: int
    rows: list[dict[str, Any]]
    histogram: charts.Chart
    counts: dict[str, list[tuple[Any, int]]] = field(default_factory=dict)


class SearchViews(Access):
    """``search`` and the two page kinds it builds."""

    # ---- search ------------------------------------------------------------------------
    def search(self, ns: str, expression: str, since: str, view: str, page: int) -> SearchResult:
        with self.lock(ns):
            q = self.query(ns)
            now = time.time()
            live, hit = q.match(expression, since=since or None, now=now)
            cols = q.index.columns
            hist = charts.histogram(cols["reward"][hit])
            counts = {k: q.counts(k, hit)[:10] for k in GROUP_KEYS}
            if view == "steps":
                rows, total = self._step_page(q, hit, page)
            else:
                rows, total = self._episode_page(q, hit, page)
        pages = max(1, -(-total // PAGE))
        return SearchResult(
            expression, since, view, page, live, len(hit), pages, rows, hist, counts
        )

    def _step_page(self, q: Query, hit: np.ndarray, page: int) -> tuple[list[dict], int]:
        """The page's steps, newest first (only the page is sorted)."""
        cols = q.index.columns
        end = min(len(hit), (page + 1) * PAGE)
        ts = cols["timestamp"][hit]
        top = np.argpartition(-ts, end - 1)[:end] if 0 < end < len(hit) else np.arange(len(hit))
        top = top[np.argsort(-ts[top], kind="stable")][page * PAGE : end]
        rows = hit[top]
        names = self.episode_names(q, rows)
        return [
            {**self._step_meta(q, rows, i), "episode": names[i]} for i in range(len(rows))
        ], len(hit)

    def _step_meta(self, q: Query, rows: np.ndarray, i: int) -> dict[str, Any]:
        cols, row = q.index.columns, int(rows[i])
        return {
            **step_row(cols, row),
            "timestamp": float(cols["timestamp"][row]),
            "task_id": q.store.decode_codes("task_id", [int(cols["task_id"][row])])[0],
            "agent_id": q.store.decode_codes("agent_id", [int(cols["agent_id"][row])])[0],
        }

    def _episode_page(self, q: Query, hit: np.ndarray, page: int) -> tuple[list[dict], int]:
        """The page's episodes (those with matching steps), most recent first.

        An episode's steps mostly sit in a few runs of consecutive rows (they are committed
        together), so the rows are reduced per run first in one pass and only the runs are
        sorted by episode: O(rows + runs log runs), not a sort of every row."""
        if not len(hit):
            return [], 0
        cols = q.index.columns
        codes = cols["episode"][hit]
        starts = np.flatnonzero(np.r_[True, codes[1:] != codes[:-1]])
        run_last = np.maximum.reduceat(cols["timestamp"][hit], starts)
        run_n = np.diff(np.r_[starts, len(hit)])
        run_reward = np.add.reduceat(cols["reward"][hit].astype(np.float64), starts)
        untrainable = (cols["flags"][hit] & UNTRAINABLE != 0).astype(np.int64)
        run_untrainable = np.add.reduceat(untrainable, starts)
        order = np.argsort(codes[starts], kind="stable")
        sorted_codes = codes[starts][order]
        groups = np.flatnonzero(np.r_[True, sorted_codes[1:] != sorted_codes[:-1]])
        last = np.maximum.reduceat(run_last[order], groups)
        n = np.add.reduceat(run_n[order], groups)
        reward = np.add.reduceat(run_reward[order], groups)
        untrainable = np.add.reduceat(run_untrainable[order], groups)
        pick = np.argsort(-last, kind="stable")[page * PAGE : (page + 1) * PAGE]
        first_rows = hit[starts[order[groups[pick]]]]
        names = self.episode_names(q, first_rows)
        tasks = self.decode(q, "task_id", first_rows)
        agents = self.decode(q, "agent_id", first_rows)
        out = [
            {
                "episode": names[i],
                "steps": int(n[j]),
                "reward": float(reward[j]),
                "last": float(last[j]),
                "task_id": tasks[i],
                "agent_id": agents[i],
                "untrainable": int(untrainable[j]),
            }
            for i, j in enumerate(pick.tolist())
        ]
        return out, len(groups)
