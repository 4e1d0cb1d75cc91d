"""The worker's Celery app: the ``-A`` target (``celery -A claw_tasks.worker.app worker``).

Importing it builds the app from this process's settings and hardens kombu's Redis
transport (``claw_tasks.worker.transport``); clients never import it (they send through
``claw_tasks.broker.app.client_app``)."""

from __future__ import annotations

from celery import signals

from claw_tasks.broker import rabbitmq as amqp
from claw_tasks.broker.app import make_app
from claw_tasks.settings import get_settings
from claw_tasks.worker import transport

TRANSPORT = transport.Transport  # registered for redis:// and rediss:// by the import


@signals.celeryd_after_setup.connect
def _declare_amqp_queues(sender: str, instance: object, conf: object, **_: object) -> None:
    if amqp.is_amqp(instance.app.conf.broker_url):  # type: ignore[attr-defined]  # Celery's signal sender is typed object
        amqp.declare_all(instance.app)  # type: ignore[attr-defined]  # Celery's signal sender is typed object


app = make_app(get_settings())
