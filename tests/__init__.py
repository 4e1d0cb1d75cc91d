"""Claw's tests, by what they need: ``unit/`` nothing but the code (mirrors the packages),
``stack/`` real Redis, Celery workers and RabbitMQ, ``system/`` the whole product from
outside (browser, Compose files, README, examples, demo, load), ``support/`` the helpers."""
