"""What the inspector's pages show, computed from the sampling index (synced from the
change logs on each request) and the store: no page reads a whole namespace from Redis
or sends one to the browser. ``Inspector`` is what the web app calls: the namespaces,
quality and snapshots pages here, the others in ``search``, ``episode`` and ``curation``,
all reading through ``access``."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from claw_tasks.format.schema import tag_key
from claw_tasks.store import Store
from claw_tasks.store.keyscan import list_namespaces
from claw_tasks.store.labels import diff
from orchestrator.inspect.stats import Statistics
from orchestrator.web import charts
from orchestrator.web.curation import CurationViews
from orchestrator.web.episode import EpisodeViews
from orchestrator.web.search import SearchViews

NAMESPACE_PAGE = 25  # namespaces a page shows: each costs its stats and an index sync


@dataclass
class NamespacePage:
    prefix: str  # only namespaces whose name starts with it
    page: int
    pages: int
    total: int  # namespaces with the prefix
    rows: list[dict[str, Any]]
    unreadable: dict[str, str]  # namespace -> why (`claw doctor` says more)


class Inspector(SearchViews, EpisodeViews, CurationViews):
    """Every page's data, for the web app; see :class:`~orchestrator.web.access.Access`
    for the per-namespace state the pages share."""

    # ---- namespaces --------------------------------------------------------------------
    def namespaces(self, prefix: str = "", page: int = 0) -> NamespacePage:
        """One page of namespaces, by name: a Redis of many namespaces (a buffer per SB3
        run makes one each) costs a page's stats and index syncs, not every namespace's."""
        now = time.time()
        names = [ns for ns in list_namespaces(self.r) if ns.startswith(prefix)]
        pages = max(1, -(-len(names) // NAMESPACE_PAGE))
        page = min(page, pages - 1)
        shown = names[page * NAMESPACE_PAGE : (page + 1) * NAMESPACE_PAGE]
        out = []
        census = Statistics(self.r).collect(shown)
        for st in census.namespaces:
            ns = st.namespace
            store = Store(self.r, ns)
            with self.lock(ns):
                q = self.query(ns)
                ts = q.index.columns["timestamp"]
            archived = sum(w or 0 for w in store.watermarks())
            out.append(
                {
                    "name": ns,
                    "steps": st.info["steps"],
                    "capacity": st.info["capacity"],
                    "committed": st.info["committed_total"],
                    "episodes": st.episodes,
                    "memory_bytes": st.memory_bytes,
                    "bytes_per_step": st.bytes_per_step,
                    "reward_mean": st.reward_mean,
                    "reward_std": st.reward_std,
                    "dead_letters": st.info["dead_letters"],
                    "evictions": st.evictions,
                    "archived": archived,
                    "rate": charts.rate(ts, now),
                }
            )
        return NamespacePage(prefix, page, pages, len(names), out, census.unreadable)

    # ---- data quality ------------------------------------------------------------------
    def quality(self, ns: str) -> dict[str, Any] | None:
        """The last quality pass, with its charts: each field's histogram, the share of
        each skill and task per window and the reward mean per window (oldest first)."""
        self.store(ns)  # a namespace that does not exist raises: the app's 404
        q = Statistics(self.r).quality(ns)
        if q is None:
            return None
        fields = []
        for name, st in q["fields"].items():
            lo, hi = st["edges"] or (0.0, 0.0)
            label = tag_key(name[2:]) if name.startswith("t:") else name
            chart = charts.bins(st["hist"][1:-1], lo, hi)
            fields.append(
                {
                    "name": label,
                    **st,
                    "chart": chart,
                    "below": st["hist"][0],
                    "above": st["hist"][-1],
                }
            )
        shares = {}
        for key in ("skill_tag", "task_id"):
            per = q["windows"].get(key, {})
            totals = [sum(v[w] for v in per.values()) for w in range(len(q["rewards"]))]
            series = {
                value or "(none)": [c / t if t else None for c, t in zip(v, totals, strict=True)][
                    ::-1
                ]
                for value, v in sorted(per.items())
            }
            shares[key] = charts.lines(series, lo=0.0, hi=1.0)
        rewards = {"mean": [w["mean"] for w in q["rewards"]][::-1]}
        return {**q, "field_rows": fields, "shares": shares, "reward_chart": charts.lines(rewards)}

    # ---- snapshots ---------------------------------------------------------------------
    def snapshots(self, ns: str, compare: str | None = None) -> list[dict[str, Any]]:
        """Each snapshot from its header alone (the listing reads no snapshot's columns:
        its cost does not grow with capacity), and for snapshot ``compare`` (if it is
        one) what changed since, against the namespace now (``diff``: that snapshot's
        and the namespace's labels read whole, one snapshot per request)."""
        store = self.store(ns)
        out = []
        for s in store.snapshots():
            row: dict[str, Any] = {
                "name": s.name,
                "created": s.created,
                "steps": s.steps,
                "bytes": s.bytes,
                "recipes": sorted(s.extra.get("recipes", {})),
                "diff": None,
                "labels": None,
            }
            if s.name == compare:
                d = diff(store.labels(s.name), store.labels())
                row["diff"] = d
                row["labels"] = d.untrainable + d.trainable + d.quality + sum(d.tags.values())
            out.append(row)
        return out
