"""A recipe's figures, read in one place: :meth:`BatchClient.stats
<orchestrator.delivery.client.BatchClient.stats>`, ``claw recipes`` and the Prometheus
exporter (through :mod:`orchestrator.inspect.stats`, which holds them per namespace) all
report :func:`recipe_stats`, so no two of them can disagree. :func:`why_empty` explains a
pop's timeout from them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from claw_tasks.store import Store
from orchestrator.delivery import admission, ratelimit, samplestats
from orchestrator.delivery.registry import POPPED, PRODUCED, SAMPLED, SKIPPED, WAIT_S, Registry
from orchestrator.delivery.rollout_state import State, read_state
from orchestrator.recipe.options import RateLimit

Histogram = tuple[list[tuple[str, float]], float]
"""Prometheus buckets (cumulative, ``+Inf`` last) and the sum of the observations."""


@dataclass(frozen=True)
class RecipeStats:
    """One recipe's queue, counters, rate-limit verdict and fill measurements."""

    version: int
    reader_hosts: int
    depth: int  # batches ready in the recipe's queue
    max_depth: int
    produced: int
    popped: int
    skipped: int  # unreadable queue items the clients skipped
    sampled_rows: int
    inserted_steps: int  # the namespace's, as the rate limiter weighs them
    verdict: ratelimit.Verdict
    state: str  # the last fill's
    wait_seconds: float  # trainers' pops waiting on the empty queue
    hit_rates: dict[str, float]  # source -> its last fill's candidates over live steps
    sample_seconds: Histogram  # time to make a batch
    batch_rows: Histogram
    rollout: State | None  # an on-policy recipe's
    admission: dict[str, Any] | None  # an admission recipe's budget and counters (or {})
    served_staleness: dict[str, Any] | None  # an admission recipe's batches, once served

    def to_json(self) -> dict[str, Any]:
        """What ``BatchClient.stats`` returns for the recipe."""
        out: dict[str, Any] = {
            "version": self.version,
            "reader_hosts": self.reader_hosts,
            "depth": self.depth,
            "max_depth": self.max_depth,
            "produced": self.produced,
            "popped": self.popped,
            "skipped": self.skipped,
            "sampled_rows": self.sampled_rows,
            "inserted_steps": self.inserted_steps,
            "rate_limited": not self.verdict,
            "rate_limit": self.verdict.reason,
            "state": self.state,
        }
        if self.rollout is not None:
            out["rollout"] = self.rollout.describe()
        if self.admission is not None:
            out["admission"] = {**self.admission, "served_staleness": self.served_staleness}
        return out


def recipe_stats(
    store: Store,
    registry: Registry,
    names: Sequence[str] | None = None,
    *,
    budget: dict[str, Any] | None = None,
) -> dict[str, RecipeStats]:
    """Per recipe of ``names`` (default: every registered one, skipping any unregistered
    meanwhile; a name given that is not registered raises). ``budget``: the namespace's
    admission state (``{}``: none declared) when the caller read it already; else it is
    read here, once, if a recipe has ``admission``."""
    given = names is not None
    names = list(names) if given else registry.names()
    inserted = registry.inserted() if names and store.exists() else 0
    out: dict[str, RecipeStats] = {}
    for n in names:
        entry = registry.registered(n) if given else registry.get(n)
        if entry is None:
            continue
        rec, c = entry.recipe, registry.counts(n)
        sampled = float(c.get(SAMPLED, 0))
        if rec.admission is not None and budget is None:
            budget = admission.state(store) or {}
        out[n] = RecipeStats(
            version=rec.version,
            reader_hosts=len(entry.reader_hosts),
            depth=int(store.r.llen(registry.queue(n))),
            max_depth=rec.prefetch.depth,
            produced=int(c.get(PRODUCED, 0)),
            popped=int(c.get(POPPED, 0)),
            skipped=int(c.get(SKIPPED, 0)),
            sampled_rows=int(sampled),
            inserted_steps=inserted,
            verdict=ratelimit.check(rec.rate_limit, inserted, sampled, rec.batch_size),
            state=str(c.get("state", "")),
            wait_seconds=float(c.get(WAIT_S, 0)),
            hit_rates=samplestats.hit_rates(c),
            sample_seconds=samplestats.histogram(c, "lat"),
            batch_rows=samplestats.histogram(c, "rows"),
            rollout=None if rec.rollout is None else read_state(registry, n),
            admission=None if rec.admission is None else budget,
            served_staleness=(None if rec.admission is None else admission.served_staleness(c)),
        )
    return out


def why_empty(
    name: str,
    timeout: float | None,
    st: dict[str, Any],
    limit: RateLimit | None,
    consumers: Callable[[], int],
) -> str:
    """What the fill of recipe ``name`` did, from its stats ``st``: rate limited (its
    numbers and the rule, ``limit``), failed, short of data, or never ran because no worker
    consumes ``prefetch`` (``consumers``: asked only then)."""
    head = f"no batch of recipe {name!r} within {timeout}s"
    state = str(st["state"])
    if st["rate_limited"] and limit is not None:
        return (
            f"{head}: the rate limiter holds prefetch back ({st['rate_limit']}). Rule: "
            "sampling waits while inserted x samples_per_insert - (sampled + batch_size) < "
            "min_size x samples_per_insert - error_buffer, here samples_per_insert "
            f"{limit.samples_per_insert:g}, error_buffer {limit.error_buffer:g}, "
            f"min_size {limit.min_size}: insert more steps, or loosen rate_limit"
        )
    if state.startswith("error"):
        return f"{head}: the last fill failed ({state}); the worker's log has the traceback"
    if state.startswith("insufficient data"):
        return f"{head}: {state}"
    if consumers() == 0:
        return (
            f"{head}: no worker consumes `prefetch`: run `claw up` (or a worker: "
            "celery -A claw_tasks.worker.app worker -Q prefetch)"
        )
    return (
        f"{head}: the prefetch workers are busy (last fill: "
        f"{state or 'nothing produced yet'}); pop with a longer timeout or add workers"
    )


def prefetch_consumers(app: Any) -> int:
    """Workers that answer a broadcast and consume ``prefetch`` (only on a timeout)."""
    try:
        replies = app.control.inspect(timeout=1.0).active_queues() or {}
    except Exception:  # the broker itself is unreachable: no worker consumes anything
        return 0
    return sum(any(q.get("name") == "prefetch" for q in qs) for qs in replies.values())
