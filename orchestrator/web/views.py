"""What the inspector's pages show, computed from the sampling index (synced from the
change logs on each request) and the store: no page reads a whole namespace from Redis
or sends one to the browser."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from claw_tasks.connection.client import redis_client
from claw_tasks.format.arrays import unpackb
from claw_tasks.format.schema import LLM_FIELDS, tag_column, tag_key
from claw_tasks.format.stepmeta import TERMINATED, TRUNCATED, UNTRAINABLE, episode_code
from claw_tasks.store import NamespaceError, Store
from claw_tasks.store.labels import diff
from claw_tasks.store.layout import SPARSE_CHUNK_SLOTS
from claw_tasks.where import Where
from claw_tasks.worker.lru import LRU
from orchestrator.delivery.client import BatchClient
from orchestrator.delivery.registry import Registry
from orchestrator.inspect.namespaces import memory_by_namespace, namespace_stats
from orchestrator.inspect.query import Query
from orchestrator.maintenance.lifecycle import list_namespaces
from orchestrator.maintenance.quality import read_quality
from orchestrator.recipe.model import Recipe
from orchestrator.sampling.candidates import eligible
from orchestrator.web import charts, thumbs, transcript

PAGE = 50
NAMESPACE_PAGE = 25  # namespaces a page shows: each costs its stats and an index sync
EPISODE_PAGE = 200
GROUP_KEYS = ("task_id", "agent_id", "skill_tag")
INFO_CHARS = 2000
SMALL_VECTOR = 16  # vector observations up to this many values are shown as numbers
DECODED = ("quality", "skill_tag", "task_id", "agent_id")


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


@dataclass
class NamespacePage:
    prefix: str  # only namespaces whose name starts with it
    page: int
    pages: int
    total: int  # namespaces with the prefix
    rows: list[dict[str, Any]]


class Inspector:
    """Per-namespace indexes (least recently used dropped), thumbnails, and the clients
    that change recipes. Thread-safe: one lock per namespace around its index."""

    def __init__(self, redis_url: str, broker_url: str, max_namespaces: int = 8) -> None:
        self.redis_url, self.broker_url = redis_url, broker_url
        self.r = redis_client(redis_url)
        self._queries: LRU[str, Query] = LRU(max_namespaces)
        self._locks: dict[str, threading.Lock] = {}
        self._clients: dict[str, BatchClient] = {}
        self._guard = threading.Lock()
        self.thumbs: LRU[tuple[str, int, str], bytes] = LRU(2048)

    # ---- plumbing --------------------------------------------------------------------
    def store(self, ns: str) -> Store:
        store = Store(self.redis_url, ns)
        if not store.exists():
            raise NamespaceError(f"namespace {ns!r} does not exist")
        return store

    def lock(self, ns: str) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(ns, threading.Lock())

    def query(self, ns: str) -> Query:
        """The namespace's query engine, its index synced now (call under ``lock(ns)``)."""
        q = self._queries.get(ns, lambda: Query(self.store(ns)))
        q.index.sync()
        return q

    def client(self, ns: str) -> BatchClient:
        with self._guard:
            if ns not in self._clients:
                self._clients[ns] = BatchClient(ns, self.redis_url, broker_url=self.broker_url)
            return self._clients[ns]

    def close(self) -> None:
        for c in self._clients.values():
            c.close()

    def episode_names(self, q: Query, rows: np.ndarray) -> list[str]:
        cols, cap = q.index.columns, q.index.cap
        with self.r.pipeline(transaction=False) as pipe:
            for row in rows.tolist():
                pipe.hget(q.store.keys.shard_key(row // cap, "epname"), int(cols["episode"][row]))
            return [(v or b"?").decode(errors="replace") for v in pipe.execute()]

    def _decode(self, q: Query, column: str, rows: np.ndarray) -> list[Any]:
        return q.store.decode_codes(column, q.index.columns[column][rows].tolist())

    # ---- namespaces --------------------------------------------------------------------
    def namespaces(self, prefix: str = "", page: int = 0) -> NamespacePage:
        """One page of namespaces, by name: a Redis of many namespaces (a buffer per SB3
        run makes one each) costs a page's stats and index syncs, not every namespace's."""
        now = time.time()
        names = [ns for ns in list_namespaces(self.r) if ns.startswith(prefix)]
        pages = max(1, -(-len(names) // NAMESPACE_PAGE))
        page = min(page, pages - 1)
        shown = names[page * NAMESPACE_PAGE : (page + 1) * NAMESPACE_PAGE]
        memory = memory_by_namespace(self.r, among=set(shown))
        out = []
        for ns in shown:
            store = Store(self.redis_url, ns)
            st = namespace_stats(store, memory.get(ns, 0))
            with self.lock(ns):
                q = self.query(ns)
                ts = q.index.columns["timestamp"]
            cfg = store.config()
            with self.r.pipeline(transaction=False) as pipe:
                for s in range(cfg.n_shards):
                    pipe.get(store.keys.archived(s))
                archived = sum(int(v or 0) for v in pipe.execute())
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
        return NamespacePage(prefix, page, pages, len(names), out)

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
        flags = int(cols["flags"][row])
        return {
            "id": int(cols["id"][row]),
            "step_index": int(cols["step_index"][row]),
            "reward": float(cols["reward"][row]),
            "priority": float(cols["priority"][row]),
            "timestamp": float(cols["timestamp"][row]),
            "task_id": q.store.decode_codes("task_id", [int(cols["task_id"][row])])[0],
            "agent_id": q.store.decode_codes("agent_id", [int(cols["agent_id"][row])])[0],
            "terminated": bool(flags & TERMINATED),
            "truncated": bool(flags & TRUNCATED),
            "trainable": not flags & UNTRAINABLE,
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
        tasks = self._decode(q, "task_id", first_rows)
        agents = self._decode(q, "agent_id", first_rows)
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

    # ---- episode -----------------------------------------------------------------------
    def episode(self, ns: str, name: str, page: int) -> dict[str, Any]:
        with self.lock(ns):
            q = self.query(ns)
            cols, cap, n_shards = q.index.columns, q.index.cap, q.index.n_shards
            code = episode_code(name)
            shard = code % n_shards
            part = slice(shard * cap, (shard + 1) * cap)
            rows = np.flatnonzero((cols["episode"][part] == code) & cols["alive"][part])
            rows = rows + shard * cap
            rows = rows[np.argsort(cols["step_index"][rows], kind="stable")]
            rewards = cols["reward"][rows].astype(np.float64)
            page = min(page, max(0, -(-len(rows) // EPISODE_PAGE) - 1))  # past the end: the last
            page_rows = rows[page * EPISODE_PAGE : (page + 1) * EPISODE_PAGE]
            meta = {k: v[page_rows] for k, v in cols.items()}  # copies: the index has them all
            group = (
                transcript.rollouts(cols, transcript.group_rows(cols, rows), code)
                if len(rows)
                else []
            )
            rows_of = np.array([g["row"] for g in group], np.int64)
            for g, gname in zip(group, self.episode_names(q, rows_of), strict=True):
                g["name"] = gname
        if not len(rows):
            raise KeyError(f"episode {name!r} has no stored steps in {ns!r}")
        store = q.store
        schema = store.config().schema
        assert schema is not None
        images, small, other = [], [], []
        for fname, spec in schema.fields.items():
            layout = None if spec.ragged else thumbs.image_layout(spec.dtype, spec.shape)
            if layout is not None:
                images.append(fname)
            elif not spec.ragged and spec.row_items <= SMALL_VECTOR:
                small.append(fname)
            else:
                other.append((fname, spec.describe()))
        ids = meta["id"]
        shards, slots = page_rows // cap, page_rows % cap
        fields = store.read_fields(shards, slots, small) if small else {}
        infos = self._infos(store, ids, n_shards, cap)
        names = {c: store.decode_codes(c, meta[c].tolist()) for c in DECODED}
        tags = {}
        for tag, kind in (schema.tags or {}).items():
            col = meta[tag_column(tag)]
            tags[tag] = store.decode_codes(tag_column(tag), col.tolist()) if kind == "str" else col
        steps = []
        for i in range(len(ids)):
            flags = int(meta["flags"][i])
            steps.append(
                {
                    "id": int(ids[i]),
                    "step_index": int(meta["step_index"][i]),
                    "reward": float(meta["reward"][i]),
                    "priority": float(meta["priority"][i]),
                    "terminated": bool(flags & TERMINATED),
                    "truncated": bool(flags & TRUNCATED),
                    "trainable": not flags & UNTRAINABLE,
                    "quality": names["quality"][i],
                    "skill_tag": names["skill_tag"][i],
                    "tags": {k: _plain(v[i]) for k, v in tags.items()},
                    "fields": {f: _values(fields[f][i]) for f in small},
                    "info": _info_text(infos[i]),
                }
            )
        llm_view = None
        if transcript.is_llm(schema.fields):
            ragged = [f for f in (*LLM_FIELDS, "response_mask") if f in schema.fields]
            got = store.read_fields(shards, slots, ragged)
            llm_view = {"turns": transcript.turns(steps, infos, got), "group": group}
        return {
            "name": name,
            "steps": steps,
            "total": len(rows),
            "page": page,
            "llm": llm_view,
            "pages": max(1, -(-len(rows) // EPISODE_PAGE)),
            "task_id": names["task_id"][0] if len(ids) else None,
            "agent_id": names["agent_id"][0] if len(ids) else None,
            "curve": charts.polyline(rewards, width=640, height=120),
            "return": float(rewards.sum()),
            "images": images,
            "other": other,
        }

    def _infos(self, store: Store, ids: np.ndarray, n_shards: int, cap: int) -> list[Any]:
        """Each step's ``info`` (None: none; untrusted: shown escaped, cut short)."""
        with self.r.pipeline(transaction=False) as pipe:
            for i in ids.tolist():
                slot = (i // n_shards - 1) % cap
                pipe.hget(store.keys.sparse(i % n_shards, "info", slot // SPARSE_CHUNK_SLOTS), slot)
            raw = pipe.execute()
        out = []
        for b in raw:
            try:
                out.append(None if b is None else unpackb(b))
            except Exception as e:  # not ours to fail on: show why
                out.append(f"(unreadable info: {type(e).__name__})")
        return out

    def thumbnail(self, ns: str, step_id: int, fname: str) -> bytes:
        def make() -> bytes:
            store = self.store(ns)
            schema = store.config().schema
            spec = None if schema is None else schema.fields.get(fname)
            layout = (
                None if spec is None or spec.ragged else thumbs.image_layout(spec.dtype, spec.shape)
            )
            if spec is None or layout is None:
                raise thumbs.NotAnImage(f"field {fname!r} is not an image field of {ns!r}")
            thumbs.check_limits(tuple(int(d) for d in spec.shape), spec.row_bytes)
            arr = store.get([step_id], fields=[fname])[fname][0]
            return thumbs.to_png(arr, layout)

        return self.thumbs.get((ns, step_id, fname), make)

    # ---- data quality ------------------------------------------------------------------
    def quality(self, ns: str) -> dict[str, Any] | None:
        """The last quality pass, with its charts: each field's histogram, the share of
        each skill and task per window and the reward mean per window (oldest first)."""
        q = read_quality(self.store(ns))
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
    def snapshots(self, ns: str) -> list[dict[str, Any]]:
        """Each snapshot with what changed since (against the namespace now)."""
        store = self.store(ns)
        found = store.snapshots()
        now = store.labels() if found else None
        out = []
        for s in found:
            assert now is not None
            d = diff(store.labels(s.name), now)
            out.append(
                {
                    "name": s.name,
                    "created": s.created,
                    "steps": s.steps,
                    "bytes": s.bytes,
                    "recipes": sorted(s.extra.get("recipes", {})),
                    "diff": d,
                    "labels": d.untrainable + d.trainable + d.quality + sum(d.tags.values()),
                }
            )
        return out

    # ---- curation and recipes ----------------------------------------------------------
    def candidates(self, q: Query, recipe: Recipe) -> int:
        """Steps the recipe's sources may draw from now (alive, trainable, matching)."""
        cols, now = q.index.columns, time.time()
        ok = eligible(cols)
        total = 0
        for src in recipe.sources:
            where = Where(src.where, q.tags, q.strings.encode)
            total += int((ok & where.mask(cols, recipe.params, now=now)).sum())
        return total

    def curate(
        self,
        ns: str,
        who: str,
        *,
        episodes: list[str],
        ids: list[int],
        trainable: bool | None,
        quality: str | None,
        tags: dict[str, str | float],
    ) -> dict[str, Any]:
        """Label the episodes and steps, then move every recipe of the namespace to a new
        version (so batches queued before the labels are dropped, here and at pop).
        Returns the steps labelled and each recipe's candidates before and after."""
        store = self.store(ns)
        registry = Registry(store)
        recipes = [e.recipe for n in registry.names() if (e := registry.get(n)) is not None]
        with self.lock(ns):
            q = self.query(ns)
            before = {r.name: self.candidates(q, r) for r in recipes}
        labels = {"trainable": trainable, "quality": quality, "tags": tags or None, "by": who}
        done = 0
        for name in episodes:
            done += store.curate(episode_id=name, **labels)
        if ids:
            done += store.curate(ids, **labels)
        versions = {}
        client = self.client(ns) if recipes else None
        for r in recipes:
            assert client is not None
            versions[r.name] = client.set_params(r.name).version
        with self.lock(ns):
            q = self.query(ns)
            after = {r.name: self.candidates(q, r) for r in recipes}
        return {
            "steps": done,
            "recipes": [
                {
                    "name": r.name,
                    "before": before[r.name],
                    "after": after[r.name],
                    "old_version": r.version,
                    "version": versions[r.name],
                }
                for r in recipes
            ],
        }

    def recipes(self, ns: str) -> list[dict[str, Any]]:
        store = self.store(ns)
        registry = Registry(store)
        names = registry.names()
        stats = self.client(ns).stats() if names else {}
        out = []
        for n in names:
            entry = registry.get(n)
            if entry is None or n not in stats:
                continue
            out.append(
                {
                    "name": n,
                    "recipe": entry.recipe,
                    **stats[n],
                    "params": {k: json.dumps(v) for k, v in entry.recipe.params.items()},
                }
            )
        return out

    def set_params(self, ns: str, who: str, name: str, raw: dict[str, str]) -> Recipe:
        """Parse each value as JSON (a bare word is a string) and set the recipe's live
        params; raises ValueError (pydantic's, or ours) naming what is wrong."""
        params: dict[str, Any] = {}
        for k, text in raw.items():
            try:
                params[k] = json.loads(text)
            except json.JSONDecodeError:
                params[k] = text
        store = self.store(ns)
        schema = store.schema()
        entry = Registry(store).get(name)
        if entry is None:
            raise KeyError(f"recipe {name!r} is not registered in {ns!r}")
        candidate = Recipe.model_validate(
            {**entry.recipe.model_dump(), "params": {**entry.recipe.params, **params}}
        )
        if schema is not None:
            candidate.validate_against(schema)
        recipe = self.client(ns).set_params(name, **params)
        store.audit(
            who, "set_params", {"recipe": name, "params": params, "version": recipe.version}
        )
        return recipe


def _info_text(info: Any) -> str:
    if info is None:
        return ""
    text = info if isinstance(info, str) else json.dumps(info, default=str, ensure_ascii=False)
    return text if len(text) <= INFO_CHARS else text[:INFO_CHARS] + "…"


def _plain(v: Any) -> Any:
    if isinstance(v, np.floating):
        return None if np.isnan(v) else float(v)
    return v


def _values(a: Any) -> str:
    arr = np.asarray(a)
    if arr.ndim == 0:
        return f"{arr.item():.4g}" if arr.dtype.kind == "f" else str(arr.item())
    return ", ".join(f"{x:.3g}" if arr.dtype.kind == "f" else str(x) for x in arr.ravel())
