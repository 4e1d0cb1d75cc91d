"""Tests against real services: private redis-servers (or a local Redis Cluster), Celery
worker processes, RabbitMQ vhosts (fixtures in tests/conftest.py)."""
