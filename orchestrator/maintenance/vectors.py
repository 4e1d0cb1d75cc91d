"""``claw.maintenance.vectors``: keep every namespace's vector indexes current (beat, 10 s).

Per namespace with indexes (``claw:{ns}:vx``) the worker syncs its maintenance sampling
index and runs each index's :class:`~orchestrator.retrieval.writer.Writer` for up to
``TICK_BUDGET_S``: new steps are projected and persisted, the quantizer trained when due
(orchestrator/retrieval/). A namespace that fails does not stop the others; the task then
raises, so Flower shows it FAILED with the error.
"""

from __future__ import annotations

import logging
from typing import Any

from claw_tasks.settings import get_settings
from claw_tasks.store import NamespaceError, Store
from claw_tasks.store.keyscan import list_namespaces
from claw_tasks.worker.app import app
from claw_tasks.worker.caches import redis_client, store_for
from claw_tasks.worker.lru import LRU
from orchestrator.maintenance.evict import MaintenanceError
from orchestrator.maintenance.lifecycle import forget, synced_index
from orchestrator.retrieval import list_indexes
from orchestrator.retrieval.storage import defs_key
from orchestrator.retrieval.writer import Writer

log = logging.getLogger(__name__)
TICK_BUDGET_S = 5.0
"""Projection work per beat tick and index; the rest waits for the next tick."""
writers: LRU[tuple[str, float, str, str], Writer] = LRU(get_settings().namespace_cache_size)


def update_indexes(store: Store, budget_s: float = TICK_BUDGET_S) -> dict[str, Any]:
    """Run every vector index of ``store``'s namespace once; returns counts by index."""
    specs = list_indexes(store)
    if not specs:
        return {}
    cfg = store.config(refresh=True)
    if cfg.schema is None:
        return {}
    index, strings = synced_index(store)
    out = {}
    for name, spec in specs.items():
        key = (store.namespace, cfg.created, name, spec.model_dump_json())
        writer = writers.get(key, lambda s=spec: Writer(store, s, get_settings().features))
        out[name] = writer.run(index, strings, budget_s)
    return out


@app.task(name="claw.maintenance.vectors", acks_late=False, ignore_result=True)
def vectors() -> dict[str, Any]:
    """Update every namespace's vector indexes; raise (FAILED in Flower) on failures."""
    r = redis_client()
    done, failed = {}, {}
    for ns in list_namespaces(r):
        try:
            store = store_for(ns)
            if not r.exists(defs_key(store)):
                continue
            done[ns] = update_indexes(store)
        except NamespaceError:
            forget(ns)
        except Exception as e:
            log.exception("vector index update in %s failed", ns)
            failed[ns] = f"{type(e).__name__}: {e}"
            writers.drop(lambda key, ns=ns: key[0] == ns)
    if failed:
        raise MaintenanceError(
            f"vector index update failed in {len(failed)} namespace(s): {failed}"
        )
    return done
