"""The worker's side of the Redis broker: its transport keeps one client per channel, and
its task events still reach whoever watches (Flower), held and sent in bursts."""

from __future__ import annotations

import base64
import json
import time

import numpy as np
from kombu import Connection

from claw_tasks.client import Ingestor
from claw_tasks.connection.server import RedisServer
from claw_tasks.worker.transport import Transport


def test_the_transport_keeps_one_client_across_acks_until_its_pool_changes():
    with RedisServer() as srv, Connection(srv.url, transport=Transport) as conn:
        queue = conn.SimpleQueue("claw-test")
        channel = queue.channel
        with channel.conn_or_acquire() as first:
            pass
        for i in range(20):
            queue.put({"i": i})
            queue.get(timeout=5).ack()
        with channel.conn_or_acquire() as again:
            assert again is first
        assert srv.client().llen("claw-test") == 0
        assert srv.client().hlen("unacked") == 0  # the acks went through the kept client
        channel._after_fork()  # kombu drops the pools in a forked child: a new client
        with channel.conn_or_acquire() as after:
            assert after is not first and after.ping()
        queue.close()


def test_every_ingest_job_s_events_reach_a_watcher_in_fewer_messages(
    redis_url, namespace, start_worker, r
):
    start_worker("ingest", 2)
    pubsub = r.pubsub(ignore_subscribe_messages=True)
    pubsub.psubscribe("*celeryev*")
    n, flush = 4000, 200
    ing = Ingestor(namespace, redis_url, flush_steps=flush, flush_interval=None)
    ing.add_batch(
        {
            "obs": np.zeros((n, 64), np.float32),
            "action": np.zeros(n, np.int64),
            "reward": np.ones(n, np.float32),
            "episode_id": "e",
            "step_index": np.arange(n),
        }
    )
    assert ing.close().committed == n
    assert not r.keys("celery-task-meta-*")  # ingest tasks store no result
    # Each job's four states, as Flower shows them (sent by the producer in one round trip
    # with its task).
    seen, messages = _collect(pubsub, n // flush, time.monotonic() + 60)
    received = {u for t, u in seen if t == "task-received"}
    assert len(received) == n // flush
    for state in ("task-sent", "task-started", "task-succeeded"):
        assert {u for t, u in seen if t == state} == received
    # Held and sent together: Celery alone sends ~2.5 messages per job (one per event),
    # held ~0.25 here; fewer than one per job whatever the machine's load.
    assert messages < n // flush
    pubsub.close()


def _collect(pubsub, jobs: int, deadline: float) -> tuple[set, int]:
    """Task events (type, task id) on the event exchange until ``jobs`` succeeded, and
    how many messages carried the worker's (all but the producers' ``task-sent``)."""
    seen: set[tuple[str, str]] = set()
    messages = 0
    while sum(t == "task-succeeded" for t, _ in seen) < jobs:
        assert time.monotonic() < deadline, (len(seen), messages)
        msg = pubsub.get_message(timeout=1.0)
        if msg is None or msg["type"] != "pmessage":
            continue
        envelope = json.loads(msg["data"])
        body = json.loads(base64.b64decode(envelope["body"]))
        tasks = [e for e in (body if isinstance(body, list) else [body]) if "uuid" in e]
        messages += any(e["type"] != "task-sent" for e in tasks)
        seen |= {(e["type"], e["uuid"]) for e in tasks}
    return seen, messages
