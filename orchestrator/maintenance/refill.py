"""Maintenance tasks (queue ``maintenance``), driven by Celery beat (RedBeat)."""

from __future__ import annotations

from typing import Any

from claw_tasks.worker.app import app
from claw_tasks.worker.context import redis_client, store_for
from orchestrator.delivery.registry import ACTIVE, Registry
from orchestrator.sampling.shmfiles import reap_orphans


@app.task(name="claw.maintenance.refill", acks_late=False, ignore_result=True, expires=5)
def refill() -> dict[str, Any]:
    """Safety net for demand-driven refill (beat, every 15 s by default): ask for a fill
    of each queue below its depth that has no fill on its way."""
    sent = 0
    for raw_ns in redis_client().smembers(ACTIVE):
        reg = Registry(store_for(raw_ns.decode()))
        for name in reg.names():
            entry = reg.get(name)
            if entry is None or reg.r.llen(reg.queue(name)) >= entry.recipe.prefetch.depth:
                continue
            token = reg.take_refill_lock(name)
            if token is None:
                continue
            try:
                app.send_task("claw.prefetch.fill", args=[reg.ns, name, token], queue="prefetch")
            except BaseException:  # no fill on its way: do not hold the lock for it
                reg.release_refill_lock(name, token)
                raise
            sent += 1
    return {"fills": sent, "reaped_files": len(reap_orphans())}
