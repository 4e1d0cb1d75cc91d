"""`claw query`: ad-hoc questions over step metadata, answered from the sampling index.

The expression is the where language's string form (:mod:`claw_tasks.where`, the one
parser recipes and retention use); ``since`` adds ``age <= since``. Matching live steps
are grouped by metadata keys and aggregated: ``count``, ``mean``, ``sum``, ``min``,
``max``, ``std`` and percentiles ``pNN`` of a numeric key, e.g. ``mean(reward)``,
``p95(reward)``. Missing values (an unset priority, an absent numeric tag) are left out
of an aggregate, as numpy's ``nan*`` functions do.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from rich.table import Table

from claw_tasks.store import NamespaceError, Store
from claw_tasks.where import Key, Where, duration, lookup
from orchestrator.sampling.index import SamplingIndex
from orchestrator.sampling.joint import JointTable, JointWhere
from orchestrator.sampling.strings import Strings
from orchestrator.sampling.transitions import Transitions

_AGG = re.compile(r"(count|mean|sum|min|max|std|p(\d{1,2}(?:\.\d+)?|100))(?:\(([^()]+)\))?")
_GROUPABLE = ("code", "num", "flag")


class QueryError(ValueError):
    """A query that cannot be answered as asked; the message says what to write instead."""


@dataclass(frozen=True)
class Agg:
    label: str  # as written, e.g. "p95(reward)"
    fn: str  # count, mean, sum, min, max, std, or "p" (percentile)
    key: str | None
    q: float = 0.0  # the percentile


def parse_aggs(text: str) -> list[Agg]:
    """``count,mean(reward),p95(reward)`` → aggregates (keys are checked later)."""
    out = []
    for part in (p.strip() for p in text.split(",")):
        m = _AGG.fullmatch(part)
        if m is None:
            raise QueryError(
                f"--agg {part!r}: write count, or mean/sum/min/max/std/pNN of a numeric key, "
                "e.g. mean(reward),p95(reward)"
            )
        fn, pct, key = m.group(1), m.group(2), m.group(3)
        if fn == "count":
            if key is not None:
                raise QueryError(f"--agg {part!r}: count takes no key")
            out.append(Agg(part, "count", None))
        elif key is None:
            raise QueryError(f"--agg {part!r}: {fn} needs a key, e.g. {fn}(reward)")
        elif pct is not None:
            out.append(Agg(part, "p", key.strip(), float(pct)))
        else:
            out.append(Agg(part, fn, key.strip()))
    return out


@dataclass
class QueryResult:
    namespace: str
    expression: str
    steps: int  # live steps in the namespace
    matched: int
    group_by: list[str]
    groups: list[dict[str, Any]]  # group key values, then the aggregates by label
    values: dict[str, np.ndarray] = field(default_factory=dict)  # key -> matched rows' values
    group_index: np.ndarray | None = None  # matched row -> group number
    joint: dict[str, int] | None = None  # joint queries: complete, partial, matched joint steps
    transition: dict[str, Any] | None = None  # transition queries: from, to, window, windows

    def to_json(self) -> dict[str, Any]:
        out = {
            "namespace": self.namespace,
            "where": self.expression,
            "steps": self.steps,
            "matched": self.matched,
            "group_by": self.group_by,
            "groups": self.groups,
        }
        if self.transition is not None:
            out["transition"] = self.transition
        return out if self.joint is None else {**out, "joint": self.joint}


@dataclass(frozen=True)
class TransitionFilter:
    """A transition query: only the steps within ``window`` steps of a change of
    ``skill_tag`` from ``from_skill`` to ``to_skill`` inside an episode (a recipe source's
    ``transition``), and the number of such changes (``windows``)."""

    from_skill: str
    to_skill: str
    window: int = 1

    def __post_init__(self) -> None:
        for arg, name in (("--from-skill", self.from_skill), ("--to-skill", self.to_skill)):
            if not isinstance(name, str) or not 1 <= len(name) <= 1024:
                raise QueryError(f"{arg}: a skill_tag of 1 to 1024 characters")
        if self.from_skill == self.to_skill:
            raise QueryError(f"--from-skill and --to-skill: both are {self.from_skill!r}")
        if isinstance(self.window, bool) or not isinstance(self.window, int):
            raise QueryError(f"--transition-window {self.window!r}: an int, 1 to 64 steps")
        if not 1 <= self.window <= 64:
            raise QueryError(f"--transition-window {self.window}: 1 to 64 steps")


@dataclass(frozen=True)
class JointFilter:
    """A joint query: the expression selects joint steps by their anchor (the global
    state's tags, what the agents share), ``any_agent``/``all_agents`` by their agents'
    steps; the matched rows are every record of the complete joint steps selected
    (partial ones, with a record evicted, are counted, never matched)."""

    any_agent: str | None = None
    all_agents: str | None = None


class Query:
    """One namespace's index, synced once; :meth:`run` answers any number of queries."""

    def __init__(self, store: Store) -> None:
        if not store.exists():
            raise NamespaceError(f"namespace {store.namespace!r} does not exist")
        self.store = store
        self.index = SamplingIndex(store, payload_bytes=0)
        self.index.sync()
        self.strings = Strings(store, self.index)
        self.tags = dict(self.index.schema.tags) if self.index.schema else {}

    def key(self, name: str) -> Key:
        return lookup(name, self.tags)

    def run(
        self,
        expression: str,
        *,
        group_by: Sequence[str] = (),
        aggs: Sequence[Agg] = (),
        since: str | None = None,
        keep: Sequence[str] = (),
        now: float | None = None,
        joint: JointFilter | None = None,
        transition: TransitionFilter | None = None,
    ) -> QueryResult:
        """Match, group and aggregate; ``keep`` names keys whose matched values to return
        (for a histogram); ``joint``: match joint steps, aggregate their agents' records;
        ``transition``: match only steps in its windows, and count the windows."""
        now = time.time() if now is None else now
        counts, moved = None, None
        if joint is None:
            live, hit = self.match(expression, since=since, now=now)
        else:
            live, hit, counts = self.match_joint(expression, joint, since=since, now=now)
        if transition is not None:
            if joint is not None:
                raise QueryError("--from-skill/--to-skill: not with a joint query")
            hit, moved = self._in_windows(transition, hit)
        groups, inverse = self._groups(list(group_by), hit)
        for a in aggs:
            if a.key is not None:
                self._numeric(a.key, hit, now)  # checked even when nothing matched
        out = []
        for g, labels in enumerate(groups):
            sel = hit[inverse == g]
            row: dict[str, Any] = dict(zip(group_by, labels, strict=True))
            for a in aggs:
                values = None if a.key is None else self._numeric(a.key, sel, now)
                row[a.label] = _aggregate(a, values, len(sel))
            out.append(row)
        values = {k: self._numeric(k, hit, now) for k in keep}
        return QueryResult(
            self.store.namespace,
            expression,
            live,
            len(hit),
            list(group_by),
            out,
            values,
            inverse,
            counts,
            moved,
        )

    def _in_windows(self, f: TransitionFilter, hit: np.ndarray) -> tuple[np.ndarray, dict]:
        t = Transitions(f.from_skill, f.to_skill, f.window, self.strings.encode, self.index.cap)
        members = t.mask(self.index.columns)
        counted = {"from": f.from_skill, "to": f.to_skill, "window": f.window}
        return hit[members[hit]], {**counted, "windows": t.changes(self.index.columns)}

    def match(
        self, expression: str, *, since: str | None = None, now: float | None = None
    ) -> tuple[int, np.ndarray]:
        """Live steps in the namespace, and the index rows of those that match (ascending);
        ``since`` keeps steps stored within that duration of ``now``."""
        now = time.time() if now is None else now
        cols = self.index.columns
        rows = np.flatnonzero(cols["alive"])
        where = Where(expression.strip() or None, self.tags, self.strings.encode)
        hit = rows[where.mask(cols, rows=rows, now=now)]
        if since is not None and since.strip():
            seconds = duration(since.strip())
            if seconds is None:
                raise QueryError(f"--since {since!r}: write a duration such as 30s, 15m, 1h, 7d")
            hit = hit[cols["timestamp"][hit] >= now - seconds]
        return len(rows), hit

    def match_joint(
        self,
        expression: str,
        joint: JointFilter,
        *,
        since: str | None = None,
        now: float | None = None,
    ) -> tuple[int, np.ndarray, dict[str, int]]:
        """Live steps, the records of the complete joint steps that match (ascending), and
        the joint steps counted: complete, partial (never matched) and matched."""
        live, anchors = self.match(expression, since=since, now=now)
        table = JointTable(None, None, self.index.cap, trainable=False)
        wheres = [
            None if w is None or not w.strip() else Where(w, self.tags, self.strings.encode)
            for w in (joint.any_agent, joint.all_agents)
        ]
        cols = self.index.columns
        ok = JointWhere(table, Where(None), *wheres).mask(cols, rows=anchors, now=now)
        anchors = anchors[ok]
        rows = table.records(cols, anchors)  # ``since`` applied to the anchors
        return live, rows, {**table.counts, "matched": len(anchors)}

    def counts(self, key: str, rows: np.ndarray) -> list[tuple[Any, int]]:
        """Steps of ``rows`` per value of ``key`` (a metadata key with few values), most
        first. Dictionary codes are counted with one bincount (a page's worth of time on
        a million rows)."""
        k = self.key(key)
        if k.kind != "code":
            groups, inverse = self._groups([key], rows)
            n = np.bincount(inverse, minlength=len(groups))
            order = np.argsort(-n, kind="stable")
            return [(groups[i][0], int(n[i])) for i in order.tolist()]
        n = np.bincount(self.index.columns[k.column][rows].astype(np.int64))
        codes = np.flatnonzero(n)
        codes = codes[np.argsort(-n[codes], kind="stable")]
        return list(zip(self._labels(k, codes), n[codes].tolist(), strict=True))

    def _numeric(self, name: str, rows: np.ndarray, now: float) -> np.ndarray:
        key = self.key(name)
        col = self.index.columns[key.column][rows]
        if key.kind == "num":
            return col.astype(np.float64)
        if key.kind == "age":
            return now - col
        raise QueryError(f"{name!r} is not numeric: aggregate a number (reward, step_index, …)")

    def _groups(
        self, keys: list[str], rows: np.ndarray
    ) -> tuple[list[tuple[Any, ...]], np.ndarray]:
        """Distinct value tuples of ``keys`` over ``rows`` (sorted) and each row's group."""
        if not keys:
            return ([()] if len(rows) else []), np.zeros(len(rows), np.int64)
        parts, decoders = [], []
        for name in keys:
            key = self.key(name)
            if key.kind not in _GROUPABLE:
                raise QueryError(
                    f"--group-by {name}: group by a metadata key with few values (task_id, "
                    "agent_id, policy_version, tags.<name>, terminated, …)"
                )
            col = self.index.columns[key.column][rows]
            if key.kind == "flag":
                col = ((col & key.bit) != 0) == key.when_set
            parts.append(np.nan_to_num(col.astype(np.float64), nan=np.inf))
            decoders.append((key, name))
        stacked = np.stack(parts, axis=1) if len(rows) else np.zeros((0, len(keys)))
        uniq, inverse = np.unique(stacked, axis=0, return_inverse=True)
        columns = [self._labels(key, uniq[:, i]) for i, (key, _) in enumerate(decoders)]
        return list(zip(*columns, strict=True)), inverse.ravel()

    def _labels(self, key: Key, values: np.ndarray) -> list[Any]:
        if key.kind == "code":
            names = self.store.decode_codes(key.column, values.astype(np.int64).tolist())
            return list(names)
        if key.kind == "flag":
            return [bool(v) for v in values]
        return [None if np.isinf(v) else _number(v) for v in values]


def _number(v: float) -> int | float:
    return int(v) if float(v).is_integer() else float(v)


def _aggregate(a: Agg, values: np.ndarray | None, n: int) -> float | int | None:
    if a.fn == "count":
        return n
    assert values is not None
    values = values[~np.isnan(values)]
    if not len(values):
        return None
    fn = {
        "mean": np.mean,
        "sum": np.sum,
        "min": np.min,
        "max": np.max,
        "std": np.std,
    }.get(a.fn)
    result = np.percentile(values, a.q) if fn is None else fn(values)
    return float(result)


def histogram(result: QueryResult, key: str, path: Path) -> Path:
    """The matched rows' ``key`` values as a histogram PNG, one series per group."""
    try:
        import matplotlib
    except ImportError:
        raise QueryError(
            "--hist needs matplotlib: pip install -e '.[demo]' (make demo installs it)"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    values = result.values[key]
    values_ok = ~np.isnan(values)
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    bins = np.histogram_bin_edges(values[values_ok], bins=30) if values_ok.any() else 10
    if result.group_by and result.group_index is not None and len(result.groups) > 1:
        for g, row in enumerate(result.groups):
            sel = (result.group_index == g) & values_ok
            label = ", ".join(f"{k}={row[k]}" for k in result.group_by)
            ax.hist(values[sel], bins=bins, alpha=0.5, label=label)
        ax.legend(fontsize=8)
    else:
        ax.hist(values[values_ok], bins=bins)
    ax.set_xlabel(key)
    ax.set_ylabel("steps")
    where = result.expression.strip() or "all steps"
    ax.set_title(f"{result.namespace}: {where} ({result.matched:,} steps)", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def table(result: QueryResult) -> Table:
    """The groups as a table (fits 80 columns for a few keys and aggregates)."""
    where = result.expression.strip() or "all steps"
    t = Table(
        title=f"{result.namespace}: {where}",
        caption=f"{result.matched:,} of {result.steps:,} steps match",
    )
    heads = [
        *result.group_by,
        *(k for k in (result.groups[0] if result.groups else {}) if k not in result.group_by),
    ]
    for h in heads:
        t.add_column(h, justify="left" if h in result.group_by else "right", overflow="fold")
    for row in result.groups:
        t.add_row(*(_cell(row[h]) for h in heads))
    return t


def _cell(v: Any) -> str:
    if v is None:
        return "[dim](none)[/]"
    if isinstance(v, bool | str):
        return str(v)
    if isinstance(v, int):
        return f"{v:,}"
    return f"{v:.4g}"
