"""Per-namespace Redis ACLs: a producer and a trainer confined to their namespace's keys work
end to end against a full-access worker, and cannot read anything else."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import redis

from claw_tasks.acl import namespace_rules
from claw_tasks.client import Ingestor
from claw_tasks.redis_server import RedisServer
from claw_tasks.store.layout import Keys
from orchestrator.delivery.client import BatchClient
from orchestrator.delivery.registry import ACTIVE


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with RedisServer() as srv:
        yield srv


def _user(server: RedisServer, namespace: str) -> str:
    """Create the namespace's user; returns its URL."""
    admin = server.client()
    admin.execute_command("ACL", "SETUSER", f"u-{namespace}", "reset", "on", f">pw-{namespace}",
                          *namespace_rules(namespace))  # fmt: skip
    admin.close()
    return f"redis://u-{namespace}:pw-{namespace}@{server.host}:{server.port}/0"


def _produce(url: str, namespace: str, episodes: int, steps: int) -> None:
    ing = Ingestor(namespace, url, flush_interval=None)
    for e in range(episodes):
        with ing.episode(episode_id=f"e{e}") as ep:
            for t in range(steps):
                ep.add(np.full(4, t, np.float32), np.int64(t), float(t), priority=1.0)
    assert ing.close().committed == episodes * steps


def test_namespace_users_produce_and_train_and_see_nothing_else(server, start_worker):
    start_worker("ingest,prefetch", 2, CLAW_REDIS_URL=server.url, CLAW_BROKER_URL=server.url)
    admin = server.client()
    url_a, url_b = _user(server, "a"), _user(server, "b")
    _produce(url_b, "b", 2, 10)
    _produce(url_a, "a", 3, 20)

    trainer = BatchClient("a", url_a)
    trainer.register({"name": "r", "batch_size": 8, "fields": ["obs", "reward"],
                      "sources": [{"name": "all"}], "prefetch": {"depth": 2}})  # fmt: skip
    batch = trainer.pop("r", timeout=60)
    assert len(batch.ids) == 8 and batch["obs"].shape == (8, 4)
    assert trainer.update_priorities(batch.ids, np.full(8, 5.0)) == 8
    assert trainer.stats("r")["r"]["popped"] == 1
    trainer.close()
    assert admin.sismember(ACTIVE, "a")  # written by the worker's fill, not by the trainer
    assert admin.acl_log() == [], admin.acl_log()  # nothing above was refused

    a = redis.Redis.from_url(url_a)
    b_keys = Keys("b")
    refused = [
        lambda: a.get(b_keys.config),  # another namespace's keys
        lambda: a.getrange(b_keys.meta(0, "reward", 0), 0, -1),
        lambda: a.set(b_keys.config, b"x"),
        lambda: a.lpop("ingest"),  # in-flight messages of every namespace
        lambda: a.lrange("prefetch", 0, -1),
        lambda: a.sadd(ACTIVE, "x"),  # the directory of namespaces is the workers'
        lambda: a.scan(0),  # key names of other namespaces
        lambda: a.flushall(),
    ]
    for attempt in refused:
        with pytest.raises(redis.exceptions.NoPermissionError):
            attempt()
    assert a.exists(Keys("a").config) == 1
    assert admin.exists(b_keys.config) == 1
    a.close()
    admin.close()
