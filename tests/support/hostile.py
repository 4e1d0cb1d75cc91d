"""Raw ingest messages published straight to the queue with kombu (no Claw client, no
Celery sender): what a buggy producer or anyone with broker access can send."""

from __future__ import annotations

import time
import uuid
from typing import Any

import msgpack
import numpy as np
import redis
from kombu import Connection, Exchange, Producer, Queue

from claw_tasks.format.batch import StepBatch
from claw_tasks.format.columns import StrColumn
from claw_tasks.format.message import TASK, IngestArgs
from claw_tasks.store.layout import Keys
from claw_tasks.worker.deadletter import REJECTS_OUTCOMES

MSGPACK = "application/x-msgpack"
OUTCOMES = ("committed", "partial", "rejected", "duplicate")


def headers(task_id: str | None = None, **over: Any) -> dict[str, Any]:
    """Protocol-2 headers as Celery writes them."""
    task_id = task_id or uuid.uuid4().hex
    h = {
        "lang": "py",
        "task": TASK,
        "id": task_id,
        "shadow": None,
        "eta": None,
        "expires": None,
        "group": None,
        "group_index": None,
        "retries": 0,
        "timelimit": [None, None],
        "root_id": task_id,
        "parent_id": None,
        "argsrepr": "()",
        "kwargsrepr": "{}",
        "origin": "hostile@test",
        "ignore_result": False,
        "replaced_task_nesting": 0,
        "stamped_headers": None,
        "stamps": {},
    }
    h.update(over)
    return h


def body(args: Any, kwargs: Any = None, embed: Any = None) -> bytes:
    embed = (
        {"callbacks": None, "errbacks": None, "chain": None, "chord": None}
        if embed is None
        else embed
    )
    return msgpack.packb([args, kwargs or {}, embed], use_bin_type=True)


def ingest_body(
    namespace: str, batch_id: str, payload: bytes | None, stage_key: str | None = None
) -> bytes:
    return body(IngestArgs(namespace, batch_id, payload, stage_key).to_args())


class Publisher:
    """Publishes raw messages to the ``ingest`` queue."""

    def __init__(self, url: str) -> None:
        self.conn = Connection(url)
        self.producer = Producer(self.conn.channel())
        self.exchange = Exchange("ingest", type="direct")
        self.queue = Queue("ingest", self.exchange, routing_key="ingest")
        self.sent = 0

    def publish(
        self,
        data: Any,
        hdrs: Any = None,
        content_type: str = MSGPACK,
        content_encoding: str = "binary",
        routing_key: str = "ingest",
    ) -> None:
        self.producer.publish(
            data,
            exchange=self.exchange,
            routing_key=routing_key,
            headers=hdrs or headers(),
            content_type=content_type,
            content_encoding=content_encoding,
            serializer=None,
            declare=[self.queue],
            retry=True,
        )
        self.sent += 1

    def close(self) -> None:
        self.conn.release()


def outcomes(r: redis.Redis, *namespaces: str | None) -> dict[str, int]:
    """Outcome counters summed over namespaces (None: the worker-level rejects)."""
    total: dict[str, int] = {}
    for ns in namespaces:
        key = REJECTS_OUTCOMES if ns is None else Keys(ns).outcomes
        for k, v in r.hgetall(key).items():
            total[k.decode()] = total.get(k.decode(), 0) + int(v)
    return total


def messages_done(r: redis.Redis, *namespaces: str | None) -> int:
    o = outcomes(r, *namespaces)
    return sum(o.get(k, 0) for k in OUTCOMES)


def wait_for(r: redis.Redis, count: int, *namespaces: str | None, timeout: float = 120) -> int:
    """Wait until ``count`` messages have an outcome; returns how many do."""
    deadline = time.monotonic() + timeout
    while (n := messages_done(r, *namespaces)) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    return n


def raw_batch(n: int, episode: str = "raw", **over: Any) -> StepBatch:
    fields = over.pop("fields", None) or {
        "obs": np.zeros((n, 8), np.float32),
        "action": np.zeros(n, np.int64),
    }
    return StepBatch(
        episode=StrColumn.constant(episode, n),
        step_index=np.arange(n),
        reward=np.zeros(n, np.float32),
        terminated=np.zeros(n, bool),
        truncated=np.zeros(n, bool),
        fields=fields,
        **over,
    )


def dump_keys(r: redis.Redis, namespace: str) -> dict[bytes, bytes]:
    """DUMP of every key of a namespace (all shards)."""
    keys = list(r.scan_iter(match=f"claw:{{{namespace}*", count=1000))
    return {k: r.dump(k) for k in keys}
