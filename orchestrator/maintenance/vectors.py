"""``claw.maintenance.vectors``: keep every namespace's vector indexes current (beat, 10 s).

Per namespace with indexes (``claw:{ns}:vx``) the worker syncs its maintenance sampling
index and runs each index's :class:`~orchestrator.retrieval.writer.Writer` for up to
``TICK_BUDGET_S``: new steps are projected and persisted, the quantizer trained when due
(orchestrator/retrieval/). A namespace that fails does not stop the others; the task then
raises, so Flower shows it FAILED with the error.
"""

from __future__ import annotations

from typing import Any

from claw_tasks.settings import get_settings
from claw_tasks.store import Store
from claw_tasks.worker.app import app
from claw_tasks.worker.context import context_for
from orchestrator.maintenance.beat import each_namespace
from orchestrator.maintenance.lifecycle import synced_index
from orchestrator.retrieval import list_indexes
from orchestrator.retrieval.storage import defs_key
from orchestrator.retrieval.writer import Writer

TICK_BUDGET_S = 5.0
"""Projection work per beat tick and index; the rest waits for the next tick."""
WRITERS = "vector writers"
"""The writers' name in a namespace context: a dict of (index name, its spec) ->
:class:`~orchestrator.retrieval.writer.Writer`, one per index the namespace defines now
(every tick runs them all: a bound below their number would rebuild them round robin)."""


def update_indexes(store: Store, budget_s: float = TICK_BUDGET_S) -> dict[str, Any]:
    """Run every vector index of ``store``'s namespace once; returns counts by index."""
    specs = list_indexes(store)
    if not specs:
        return {}
    cfg = store.config(refresh=True)
    if cfg.schema is None:
        return {}
    index, strings = synced_index(store)  # first: a namespace made again starts cold
    writers: dict[tuple[str, str], Writer] = context_for(store).part(WRITERS, dict)
    keys = {name: (name, spec.model_dump_json()) for name, spec in specs.items()}
    for gone in set(writers) - set(keys.values()):  # an index removed or redefined
        del writers[gone]
    out = {}
    for name, spec in specs.items():
        if (writer := writers.get(keys[name])) is None:
            writer = writers[keys[name]] = Writer(store, spec, get_settings().features)
        out[name] = writer.run(index, strings, budget_s)
    return out


@app.task(name="claw.maintenance.vectors", acks_late=False, ignore_result=True)
def vectors() -> dict[str, Any]:
    """Update every namespace's vector indexes; raise (FAILED in Flower) on failures."""

    def work(store: Store) -> dict[str, Any] | None:
        return update_indexes(store) if store.r.exists(defs_key(store)) else None

    return each_namespace("vector index update", work)
