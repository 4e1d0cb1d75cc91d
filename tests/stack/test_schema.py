"""Schema is immutable: a cached schema can be shared without anyone changing it."""

from __future__ import annotations

import numpy as np
import redis

from claw_tasks.client import Ingestor
from claw_tasks.format.schema import FieldSpec, Schema
from claw_tasks.store import Store

FIELDS = {"obs": FieldSpec("<f4", (4,)), "action": FieldSpec("<i8", ())}


def test_ingestor_new_tag_reaches_redis(redis_url, namespace):
    """A step's new tag reaches Redis: were the Ingestor to add it to the Store's cached
    schema in place, ``ensure_schema`` would think Redis had it and skip the write."""
    Store(redis_url, namespace).create(schema=Schema(fields=dict(FIELDS)))
    broker = redis_url.rsplit("/", 1)[0] + "/1"  # no worker: keep the message off "ingest"
    # claim_check_bytes=0: the payload is written in place, after Store.ensure_schema
    ing = Ingestor(
        namespace, redis_url, broker_url=broker, flush_interval=None, claim_check_bytes=0
    )
    try:
        with ing.episode(color="red") as ep:
            ep.add(np.zeros(4, np.float32), np.int64(1), 1.0)
        ing.flush(wait=False)
        assert dict(Store(redis_url, namespace).schema().tags) == {"color": "str"}
        assert dict(ing.store.config().schema.tags) == {"color": "str"}
    finally:
        ing.store.r.close()
        redis.Redis.from_url(broker).flushdb()
