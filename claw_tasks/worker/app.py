"""The worker's Celery app: the ``-A`` target (``celery -A claw_tasks.worker.app worker``).

Importing it builds the app from this process's settings and hardens kombu's Redis
transport (``claw_tasks.worker.transport``); clients never import it (they send through
``claw_tasks.broker.app.client_app``)."""

from __future__ import annotations

import logging

from celery import signals
from redis.exceptions import RedisClusterException, RedisError

from claw_tasks.broker import rabbitmq as amqp
from claw_tasks.broker.app import make_app
from claw_tasks.connection.client import redis_client
from claw_tasks.settings import get_settings
from claw_tasks.store.replication import replicas_advice
from claw_tasks.worker import transport

TRANSPORT = transport.Transport  # registered for redis:// and rediss:// by the import


@signals.celeryd_after_setup.connect
def _declare_amqp_queues(sender: str, instance: object, conf: object, **_: object) -> None:
    if amqp.is_amqp(instance.app.conf.broker_url):  # type: ignore[attr-defined]  # Celery's signal sender is typed object
        amqp.declare_all(instance.app)  # type: ignore[attr-defined]  # Celery's signal sender is typed object


@signals.celeryd_after_setup.connect
def _check_replicas(sender: str, instance: object, conf: object, **_: object) -> None:
    """Say at start when ``CLAW_INGEST_REPLICAS`` and the store's replicas disagree (a
    store not up yet, or a worker that does not consume the ingest queue: nothing said)."""
    if "ingest" not in instance.app.amqp.queues.consume_from:  # type: ignore[attr-defined]  # Celery's signal sender is typed object
        return
    settings = get_settings()
    try:
        client = redis_client(settings.redis_url, socket_timeout=5)
        advice = replicas_advice(client, settings.limits.replicas)
        client.close()
    except (RedisError, RedisClusterException, OSError):
        return
    if advice is not None:
        logging.getLogger(__name__).warning("%s", advice)


app = make_app(get_settings())
