"""RabbitMQ as Claw's broker (``amqp://``): durable quorum queues, publisher confirms.

Why quorum queues: they are replicated and durable, and they count redeliveries
(``x-delivery-count``), which lets the worker's guard dead-letter a message that keeps
coming back (a task that kills its worker every time) instead of looping on it. They have
no global QoS (Celery then applies ``worker_prefetch_multiplier`` per consumer) and no
broker-side ETA: a countdown retry goes through kombu's native delayed delivery, which
needs topic exchanges — so the three queues hang off one topic exchange, ``claw``, and a
delayed message comes back with its delay (28 binary digits) in front of its routing key.

The at-least-once settings are the same as on Redis (late acks, reject on worker lost,
one message per process); what differs is where an unacked message waits: RabbitMQ
returns it as soon as the worker's connection closes (no visibility timeout).
"""

from __future__ import annotations

import re
from typing import Any

from kombu import Exchange, Queue

EXCHANGE = Exchange("claw", type="topic", durable=True)
QUEUE_ARGUMENTS = {"x-queue-type": "quorum"}
MAX_DELIVERIES = 5
"""A message delivered this often (each time its worker died or its connection dropped
before the ack) is a poison message: the guard dead-letters it instead of running it."""
_DELAY_PREFIX = re.compile(r"^(?:[01]\.){28}")


def is_amqp(url: str) -> bool:
    return url.split("://", 1)[0] in ("amqp", "amqps", "pyamqp")


def queues(names: tuple[str, ...]) -> list[Queue]:
    """The Celery queues as durable quorum queues bound to the ``claw`` topic exchange."""
    return [
        Queue(n, EXCHANGE, routing_key=n, durable=True, queue_arguments=QUEUE_ARGUMENTS)
        for n in names
    ]


def declare_all(app: Any) -> None:
    """Declare every Claw queue, consumed here or not: the worker binds each of the app's
    queues to the delayed-delivery exchanges at start, and a missing one fails that."""
    with app.connection_for_write() as conn, conn.channel() as channel:
        for queue in app.amqp.queues.values():
            queue.bind(channel).declare()


def app_options() -> dict[str, Any]:
    """Celery settings only RabbitMQ understands."""
    return {
        # send() returns once RabbitMQ has the message (a producer's at-least-once).
        "broker_transport_options": {"confirm_publish": True},
        "task_default_exchange": EXCHANGE.name,
        "task_default_exchange_type": EXCHANGE.type,
    }


def queue_of(routing_key: Any) -> Any:
    """The queue a delivery's routing key names (a delayed delivery's delay removed)."""
    return _DELAY_PREFIX.sub("", routing_key) if isinstance(routing_key, str) else routing_key


def delivery_count(headers: Any) -> int:
    """How often RabbitMQ delivered this message before (0 for the first delivery)."""
    n = headers.get("x-delivery-count", 0) if isinstance(headers, dict) else 0
    return n if isinstance(n, int) and not isinstance(n, bool) else 0
