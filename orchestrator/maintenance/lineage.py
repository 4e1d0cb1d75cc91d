"""``claw.maintenance.lineage``: index every namespace's lineage log (beat, every 30 s).

A pass per namespace with a lineage stream (:meth:`~orchestrator.delivery.lineage.
LineageLog.build_index`): the entries popped since the last pass become segments of the
index, and segments the log has trimmed whole are dropped, so ``claw lineage`` reads the
index and a short tail instead of the whole log (:mod:`orchestrator.delivery.
lineage_index`). Then the recipe versions no entry of the log names any more are dropped
(:meth:`~orchestrator.delivery.registry.Registry.prune_definitions`): the log's length
(``CLAW_LINEAGE_MAXLEN``) is the one setting that keeps both. The trainer's append is
untouched: the work is here, off its path.
"""

from __future__ import annotations

from typing import Any

from claw_tasks.store import Store
from claw_tasks.worker.app import app
from orchestrator.delivery.lineage import LineageLog, lineage_key
from orchestrator.delivery.registry import Registry
from orchestrator.maintenance.beat import each_namespace


@app.task(name="claw.maintenance.lineage", acks_late=False, ignore_result=True)
def lineage() -> dict[str, Any]:
    """An index pass over every namespace's lineage log; raise (FAILED in Flower) if any
    failed (after the others). Returns the entries indexed per namespace."""

    def work(store: Store) -> int | None:
        if not store.r.exists(lineage_key(store)):
            return None
        log = LineageLog(store)
        built = log.build_index().entries
        Registry(store).prune_definitions(log.recipe_digests())
        return built

    return each_namespace("lineage indexing", work)
