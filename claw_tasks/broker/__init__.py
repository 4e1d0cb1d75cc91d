"""The Celery side both clients and workers share: the app factory with its queues and
routes (``app``), RabbitMQ's queue options (``rabbitmq``), TLS for ``rediss://`` brokers
(``tls``) and the beat schedule (``schedule``). Builds no app at import: the worker's app
is ``claw_tasks.worker.app``, a client's ``app.client_app(url)``. Imports ``settings``
and ``durations``."""
