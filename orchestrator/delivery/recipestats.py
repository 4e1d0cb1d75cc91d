"""What :meth:`BatchClient.stats <orchestrator.delivery.client.BatchClient.stats>`
reports of each recipe, and :func:`why_empty`: a pop's timeout explained from it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from claw_tasks.store import Store
from orchestrator.delivery import admission, ratelimit
from orchestrator.delivery.registry import Registry
from orchestrator.delivery.rollout_state import read_state
from orchestrator.recipe.options import RateLimit


def recipe_stats(
    store: Store, registry: Registry, names: Sequence[str]
) -> dict[str, dict[str, Any]]:
    """Per recipe of ``names``: queue depth and bound, batches produced and popped, rows
    sampled, steps inserted, the rate limiter's verdict and the last prefetch state (and
    ``rollout`` or ``admission`` for those recipes)."""
    inserted = registry.inserted() if store.exists() else 0
    out: dict[str, dict[str, Any]] = {}
    for n in names:
        entry = registry.registered(n)
        c = registry.counts(n)
        rec = entry.recipe
        sampled = float(c.get("sampled", 0))
        verdict = ratelimit.check(rec.rate_limit, inserted, sampled, rec.batch_size)
        out[n] = {
            "version": rec.version,
            "reader_hosts": len(entry.reader_hosts),
            "depth": int(store.r.llen(registry.queue(n))),
            "max_depth": rec.prefetch.depth,
            "produced": int(c.get("produced", 0)),
            "popped": int(c.get("popped", 0)),
            "skipped": int(c.get("skipped", 0)),
            "sampled_rows": int(sampled),
            "inserted_steps": inserted,
            "rate_limited": not verdict,
            "rate_limit": verdict.reason,
            "state": c.get("state", ""),
        }
        if rec.rollout is not None:
            out[n]["rollout"] = read_state(registry, n).describe()
        if rec.admission is not None:
            budget = admission.state(store)
            out[n]["admission"] = {
                **(budget or {}),
                "served_staleness": admission.served_staleness(c),
            }
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
