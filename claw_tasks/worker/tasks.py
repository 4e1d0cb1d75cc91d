"""The ingest task (Celery name ``claw_tasks.ingest``: the producers' contract, kept as is)."""

from __future__ import annotations

import logging
from typing import Any

from celery import Task
from celery.utils.dispatch import Signal
from celery.utils.time import get_exponential_backoff_interval

from claw_tasks.format.message import TASK, IngestOutcome, Rejected
from claw_tasks.settings import get_settings
from claw_tasks.store import NamespaceDropped
from claw_tasks.worker.app import app
from claw_tasks.worker.context import forget, redis_client, store_for
from claw_tasks.worker.ingest import is_transient, reject, run

BACKOFF_MAX = 60
log = logging.getLogger(__name__)

committed = Signal(name="claw_committed")
"""Sent (``namespace=``, ``steps=``) in the worker process after an ingest task committed
steps, so that what waits for them acts in the same process at once: the prefetch module
forms a waiting on-policy rollout here (``orchestrator.delivery.prefetch``). A receiver's
error is logged by Celery, never the task's (the steps are committed)."""


@app.task(
    bind=True,
    name=TASK,
    acks_late=True,
    reject_on_worker_lost=True,
    max_retries=get_settings().limits.retries,
)
def ingest(self: Task, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """Commit one batch of steps. Args ``[version, namespace, batch_id, payload,
    stage_key]`` (see ``claw_tasks.format.message``), checked here as from any sender. A batch for
    a dropped namespace is discarded (counted in ``claw:rejects``) and its Store forgotten."""
    try:
        outcome = run(redis_client(), args, kwargs, get_settings().limits, store_for)
    except NamespaceDropped:
        forget(args[1], dropped=True)
        log.warning("batch %s: namespace %r was dropped; discarded", args[2], args[1])
        return {"committed": 0, "rejected": 0, "dropped": True}
    except Exception as e:
        if not is_transient(e):
            raise
        outcome = _retry_or_give_up(self, args, e)
    if outcome.committed:
        committed.send(sender=TASK, namespace=args[1], steps=outcome.committed)
    return {"committed": outcome.committed, "rejected": outcome.rejected}


def _retry_or_give_up(task: Task, args: Any, e: Exception) -> IngestOutcome:
    """Retry a transient Redis error with exponential backoff; past ``max_retries``,
    dead-letter this delivery without a done record, so the sender (which keeps every
    unconfirmed batch) sends it again. If Redis cannot take even the letter, keep
    retrying at the longest interval: the message is never dropped."""
    retries = task.request.retries
    if retries < task.max_retries:
        countdown = get_exponential_backoff_interval(1, retries, BACKOFF_MAX, full_jitter=True)
        raise task.retry(exc=e, countdown=countdown) from None
    reason = f"Redis kept failing through {retries} retries: {type(e).__name__}: {e}"
    namespace, batch_id = args[1], args[2]  # parse_message passed: the error came after it
    payload = args[3] if isinstance(args[3], bytes) else None
    try:
        reject(
            redis_client(),
            Rejected("transient", reason, namespace),
            get_settings().limits,
            payload=payload,
            batch_id=batch_id,
        )
    except Exception as again:
        if not is_transient(again):
            raise
        raise task.retry(exc=again, countdown=BACKOFF_MAX, max_retries=None) from None
    return IngestOutcome(str(batch_id), errors=[reason])
