"""The Celery app factory: msgpack only, late acks, three routed queues. ``make_app`` is
what the worker app (``claw_tasks.worker.app``) and every sending-only client app
(``client_app``) are built from, so both agree on serializers, routes and queues."""

from __future__ import annotations

from functools import cache

from celery import Celery
from kombu import Queue

from claw_tasks.broker import rabbitmq as amqp
from claw_tasks.broker.schedule import beat_schedule
from claw_tasks.broker.tls import broker_options
from claw_tasks.settings import Settings, get_settings
from claw_tasks.store.batches import SCHEDULE_PREFIX

QUEUES = ("ingest", "prefetch", "maintenance")
# What a worker imports at start, so that every task it may be sent is registered. The
# worker runs the write path's ingest task and the read path's tasks (the prefetch fill and
# the maintenance beat schedules). orchestrator imports claw_tasks, never the reverse, so
# the read path's task modules are named here by string: a dependency of the worker on the
# read path that no import shows. tests/unit/claw_tasks/broker/test_app.py keeps the list
# exact: a module of orchestrator that defines a task and is missing here fails it (its
# task would never run), and so does a listed module that defines none.
WRITE_PATH_TASKS = ("claw_tasks.worker.tasks",)
READ_PATH_TASKS = (
    "orchestrator.delivery.prefetch",
    "orchestrator.maintenance.refill",
    "orchestrator.maintenance.evict",
    "orchestrator.maintenance.priorities",
    "orchestrator.maintenance.archive",
    "orchestrator.maintenance.vectors",
    "orchestrator.maintenance.cleaning",
    "orchestrator.maintenance.quality",
    "orchestrator.maintenance.lineage",
)


BEAT_LOOP_S = 5
BEAT_LOCK_S = 30


def make_app(settings: Settings, broker_url: str | None = None) -> Celery:
    """A configured Claw Celery app (workers use ``app``; clients may aim elsewhere)."""
    broker = broker_url or settings.broker_url
    app = Celery("claw", broker=broker, include=[*WRITE_PATH_TASKS, *READ_PATH_TASKS])
    app.conf.update(
        task_serializer="msgpack",
        result_serializer="msgpack",
        # Nothing that can run code on load: msgpack for tasks, json for events and beat.
        accept_content=["msgpack", "json"],
        result_accept_content=["msgpack", "json"],
        event_serializer="json",
        task_ignore_result=True,
        result_backend=None,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        # Checks every message before Celery parses it (a malformed one must not stop it).
        worker_consumer="claw_tasks.worker.guard:GuardedConsumer",
        broker_connection_retry_on_startup=True,
        task_default_queue="maintenance",
        task_routes={
            "claw_tasks.ingest": {"queue": "ingest"},
            "claw.prefetch.*": {"queue": "prefetch"},
            "claw.maintenance.*": {"queue": "maintenance"},
        },
        worker_send_task_events=True,
        task_send_sent_event=True,
        redbeat_redis_url=settings.beat_url,  # never a cluster (settings/environment.py)
        redbeat_key_prefix=SCHEDULE_PREFIX,
        beat_scheduler="redbeat.RedBeatScheduler",
        # Beat wakes at least every BEAT_LOOP_S and extends its lock to BEAT_LOCK_S each
        # time, so a beat SIGKILLed with the lock is replaced within BEAT_LOCK_S (RedBeat's
        # default, 5 x 300 s, stopped every maintenance task for 25 minutes).
        beat_max_loop_interval=BEAT_LOOP_S,
        redbeat_lock_timeout=BEAT_LOCK_S,
        beat_schedule=beat_schedule(settings.schedule),  # claw_tasks/broker/schedule.py
        timezone="UTC",
    )
    app.conf.update(_broker_specific(broker, settings))
    return app


def _broker_specific(broker: str, settings: Settings) -> dict[str, object]:
    """Queues and transport options for the broker at ``broker``: each broker gets only
    the options it understands (claw_tasks/broker/rabbitmq.py for RabbitMQ)."""
    if amqp.is_amqp(broker):
        return {"task_queues": amqp.queues(QUEUES), **amqp.app_options()}
    return {
        **broker_options(broker),  # TLS for rediss://
        "task_queues": [Queue(q) for q in QUEUES],
        # Unacked messages come back after this long if a worker dies outright. Ingest
        # tasks take well under a second; long maintenance work is chunked below it.
        "broker_transport_options": {
            "visibility_timeout": settings.visibility_timeout,
            # Sweep for abandoned (unacked) messages every few seconds, not every 100 s.
            "unacked_restore_interval": max(1, min(10, settings.visibility_timeout // 4)),
            "unacked_restore_throttle": 1,
        },
    }


@cache
def client_app(broker_url: str) -> Celery:
    """A sending-only app for ``broker_url`` (cached per URL)."""
    return make_app(get_settings(), broker_url)
