"""An untrusted producer for the ingest tests: sends ``StepBatch``es the way the client does
(inline message, or payload written in place first), without the client's checks."""

from __future__ import annotations

import time

import numpy as np
from celery import Celery

from claw_tasks.broker.app import client_app
from claw_tasks.format.batch import StepBatch
from claw_tasks.format.columns import Placed
from claw_tasks.format.message import IngestArgs, IngestOutcome
from claw_tasks.settings import get_settings
from claw_tasks.store import Store


def sender(redis_url: str) -> Celery:
    """A sending app for the stack whose data store is ``redis_url`` (its broker is the
    standalone server when the store is a cluster)."""
    return client_app(get_settings().broker_for(redis_url))


def send_unchecked(
    redis_url: str,
    store: Store,
    batch: StepBatch,
    *,
    in_place: bool = False,
    broker_url: str | None = None,
):
    """Publish ``batch`` to the ``claw_tasks.ingest`` task (its fixed-shape fields written in place
    first with ``in_place``: one shard) through ``broker_url`` (default: the stack's, see
    :func:`sender`); returns the task's args (to send them again)."""
    if in_place:
        fixed = {k: v for k, v in batch.fields.items() if isinstance(v, np.ndarray)}
        schema = store.ensure_schema(batch.schema())
        seq0, _ = store.allocate(
            0, batch.batch_id, batch.n, {k: schema.fields[k].row_bytes for k in fixed}
        )
        store.place(0, seq0, fixed)
        batch.fields.update({k: Placed(v.dtype, v.shape) for k, v in fixed.items()})
    args = IngestArgs(store.namespace, batch.batch_id, batch.encode(), None).to_args()
    app = client_app(broker_url) if broker_url else sender(redis_url)
    app.send_task("claw_tasks.ingest", args=args, queue="ingest")
    return args


def outcome(store: Store, batch_id: str, timeout: float = 60.0) -> IngestOutcome:
    """What the worker made of a batch (waits for its ``done`` record)."""
    deadline = time.monotonic() + timeout
    while (raw := store.r.get(store.layout_keys.done(batch_id))) is None:
        assert time.monotonic() < deadline, f"batch {batch_id} not processed within {timeout}s"
        time.sleep(0.02)
    return IngestOutcome.from_bytes(raw)
