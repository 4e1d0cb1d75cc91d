"""``claw.maintenance.lineage``: index every namespace's lineage log (beat, every 30 s).

A pass per namespace with a lineage stream (:meth:`~orchestrator.delivery.lineage.
LineageLog.build_index`): the entries popped since the last pass become segments of the
index, and segments the log has trimmed whole are dropped, so ``claw lineage`` reads the
index and a short tail instead of the whole log (:mod:`orchestrator.delivery.
lineage_index`). The trainer's append is untouched: the work is here, off its path.
"""

from __future__ import annotations

import logging
from typing import Any

from claw_tasks.store import NamespaceError
from claw_tasks.store.keyscan import list_namespaces
from claw_tasks.worker.app import app
from claw_tasks.worker.caches import redis_client, store_for
from orchestrator.delivery.lineage import LineageLog, lineage_key

log = logging.getLogger(__name__)


@app.task(name="claw.maintenance.lineage", acks_late=False, ignore_result=True)
def lineage() -> dict[str, Any]:
    """An index pass over every namespace's lineage log; raise (FAILED in Flower) if any
    failed (after the others). Returns the entries indexed per namespace."""
    r = redis_client()
    done, failed = {}, {}
    for ns in list_namespaces(r):
        try:
            store = store_for(ns)
            if not r.exists(lineage_key(store)):
                continue
            report = LineageLog(store).build_index()
        except NamespaceError:
            continue
        except Exception as e:
            log.exception("lineage index pass of %s failed", ns)
            failed[ns] = f"{type(e).__name__}: {e}"
            continue
        done[ns] = report.entries
    if failed:
        raise RuntimeError(f"lineage indexing failed in {len(failed)} namespace(s): {failed}")
    return done
